// What a look at an empty library-owned Unix listener costs (PERFORMANCE.md 35):
// accept4 that finds nothing (EAGAIN) against poll with a zero timeout, with
// getppid as the cost of a bare system call. Built and run by
// scripts/bench-kernel-path.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdio.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <poll.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
int main(void){
  int u=socket(AF_UNIX,SOCK_SEQPACKET|SOCK_NONBLOCK,0); struct sockaddr_un a={.sun_family=AF_UNIX}; a.sun_path[1]='z';
  bind(u,(void*)&a,sizeof(sa_family_t)+2); listen(u,4);
  int n=200000; double t0=now(); for(int i=0;i<n;i++) accept4(u,0,0,SOCK_NONBLOCK|SOCK_CLOEXEC); printf("accept4 EAGAIN %.0f ns\n",(now()-t0)/n);
  t0=now(); for(int i=0;i<n;i++) getppid(); printf("getppid %.0f ns\n",(now()-t0)/n);
  struct pollfd p={u,POLLIN,0}; t0=now(); for(int i=0;i<n;i++) poll(&p,1,0); printf("poll %.0f ns\n",(now()-t0)/n);
}
