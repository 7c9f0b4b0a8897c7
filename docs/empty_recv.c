/* An accelerated TCP connection (both ends in this program, forked, under the
 * library) polled with non-blocking recv() that finds nothing: ns per call, 5 runs.
 * cc -O2 -o /tmp/empty_recv docs/empty_recv.c
 * LD_PRELOAD=target/release/libstrait_preload.so /tmp/empty_recv 2000000
 * (PERFORMANCE.md section 19). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>
#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <netinet/in.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
int main(int argc,char**argv){
  int l=socket(AF_INET,SOCK_STREAM,0); struct sockaddr_in a={0}; a.sin_family=AF_INET; a.sin_addr.s_addr=htonl(0x7f000001);
  bind(l,(void*)&a,sizeof a); listen(l,4); socklen_t al=sizeof a; getsockname(l,(void*)&a,&al);
  pid_t p=fork();
  if(p==0){ int c=socket(AF_INET,SOCK_STREAM,0); connect(c,(void*)&a,sizeof a); char b; write(c,"x",1); read(c,&b,1); _exit(0);} 
  int s=accept(l,0,0); char b; read(s,&b,1);
  fcntl(s,F_SETFL,O_NONBLOCK);
  long n=atol(argv[1]); char buf[64]; int eagain=0;
  for(int rep=0;rep<5;rep++){
    double t0=now();
    for(long i=0;i<n;i++){ if(recv(s,buf,sizeof buf,0)<0 && errno==EAGAIN) eagain++; }
    double t1=now();
    printf("%.1f ns/call\n",(t1-t0)/n);
  }
  fcntl(s,F_SETFL,0); write(s,"y",1); 
  return eagain==0;
}
