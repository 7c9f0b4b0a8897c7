// One thread, N connections to its own listener (PERFORMANCE.md 35): connect
// (non-blocking), put the connecting socket in an epoll set and poll it (its
// first use, before the accept), wait for the listener, accept, write a request,
// read it, answer, read the answer, close both. Under strait each connection set
// up falls back to the kernel (the acceptor can only be this thread). Prints the
// best of 5 rounds in ns per connection. Built and run by scripts/bench-kernel-path.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/epoll.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
int main(int argc,char**argv){
  int n=argc>1?atoi(argv[1]):20000;
  int l=socket(AF_INET,SOCK_STREAM|SOCK_NONBLOCK,0); int one=1;
  setsockopt(l,SOL_SOCKET,SO_REUSEADDR,&one,4);
  struct sockaddr_in a={.sin_family=AF_INET,.sin_port=0}; a.sin_addr.s_addr=htonl(0x7f000001);
  socklen_t al=sizeof a;
  if(bind(l,(void*)&a,sizeof a)||listen(l,511)||getsockname(l,(void*)&a,&al)){perror("listen");return 1;}
  int ep=epoll_create1(0); struct epoll_event ev={.events=EPOLLIN,.data.fd=l}; epoll_ctl(ep,EPOLL_CTL_ADD,l,&ev);
  int cep=epoll_create1(0);
  char buf[512]; const char*req="GET /f100.bin HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  struct epoll_event out[8];
  double best=1e18;
  for(int round=0;round<5;round++){
   double t0=now();
   for(int i=0;i<n;i++){
    int c=socket(AF_INET,SOCK_STREAM|SOCK_NONBLOCK,0);
    setsockopt(c,IPPROTO_TCP,TCP_NODELAY,&one,4);
    connect(c,(void*)&a,sizeof a);
    struct epoll_event ce={.events=EPOLLIN|EPOLLOUT|EPOLLET,.data.fd=c}; epoll_ctl(cep,EPOLL_CTL_ADD,c,&ce);
    epoll_wait(cep,out,8,0);
    epoll_wait(ep,out,8,-1);
    int s=accept4(l,NULL,NULL,SOCK_NONBLOCK);
    if(s<0){perror("accept4");return 1;}
    struct epoll_event se={.events=EPOLLIN|EPOLLRDHUP|EPOLLET,.data.fd=s}; epoll_ctl(ep,EPOLL_CTL_ADD,s,&se);
    write(c,req,strlen(req));
    recv(s,buf,sizeof buf,0);
    write(s,buf,200);
    close(s);
    epoll_wait(cep,out,8,0);
    read(c,buf,sizeof buf); read(c,buf,sizeof buf);
    epoll_ctl(cep,EPOLL_CTL_DEL,c,NULL);
    close(c);
   }
   double t=(now()-t0)/n; if(t<best)best=t;
  }
  printf("%.0f ns/conn\n",best);
  return 0;
}
