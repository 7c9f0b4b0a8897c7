/* epoll_wait(ep, ev, 64, 0) in a tight loop on a set of N accepted TCP connections
 * (the connector, a forked child, sent one byte on each, which was read; nothing is
 * ready): ns per call, 5 runs. Without LD_PRELOAD: the kernel path.
 * cc -O2 -o /tmp/epoll_zero docs/epoll_zero.c
 * LD_PRELOAD=target/release/libstrait_preload.so /tmp/epoll_zero 1000000 100
 * (PERFORMANCE.md section 19). */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <time.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <sys/epoll.h>
#include <netinet/in.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
int main(int argc,char**argv){
  int nconn=atoi(argv[2]);
  int l=socket(AF_INET,SOCK_STREAM,0); struct sockaddr_in a={0}; a.sin_family=AF_INET; a.sin_addr.s_addr=htonl(0x7f000001);
  bind(l,(void*)&a,sizeof a); listen(l,1024); socklen_t al=sizeof a; getsockname(l,(void*)&a,&al);
  int pfd[2]; pipe(pfd);
  pid_t p=fork();
  if(p==0){ int cs[4096]; for(int i=0;i<nconn;i++){cs[i]=socket(AF_INET,SOCK_STREAM,0); connect(cs[i],(void*)&a,sizeof a); write(cs[i],"x",1);} char b; read(pfd[0],&b,1); _exit(0);} 
  int ep=epoll_create1(0);
  for(int i=0;i<nconn;i++){ int s=accept(l,0,0); char b; read(s,&b,1); struct epoll_event e={.events=EPOLLIN,.data.fd=s}; epoll_ctl(ep,EPOLL_CTL_ADD,s,&e);} 
  long n=atol(argv[1]); struct epoll_event ev[64];
  for(int rep=0;rep<5;rep++){
    double t0=now(); long got=0;
    for(long i=0;i<n;i++){ got+=epoll_wait(ep,ev,64,0); }
    double t1=now();
    printf("%.1f ", (t1-t0)/n);
    if(got) printf("(ready %ld) ",got);
  }
  printf("ns/call\n");
  write(pfd[1],"q",1);
  return 0;
}
