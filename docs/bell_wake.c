// Two threads ping-pong through a doorbell, each doing ~5 us of work after it rings
// (as a server does after waking its peer): eventfd (mode 0) against a Unix
// sequenced-packet socket (mode 1), a pipe (mode 2), and one eventfd whose ring also
// sets the ringing connection's bit in a ready bitmap of 10,240 connections that the
// woken side scans through a summary word per 64 (mode 3: a doorbell shared by many
// connections that still says which rang); prints the round trip and how often the
// woken thread ran on the waker's CPU. PERFORMANCE.md sections 24 and 25.
// Build: gcc -O2 -o bell_wake docs/bell_wake.c -lpthread; run: ./bell_wake 0 (1, 2, 3)
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <unistd.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <fcntl.h>
static int mode; static int fa[2], fb[2]; // a: main->peer, b: peer->main
#define N 20000
static volatile int waker_cpu; static int same=0;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
#define CONNS 10240
static _Atomic uint64_t ready[2][CONNS/64], summary[2][(CONNS/64+63)/64]; static int seq;
static int slot(int fd){ return fd==fa[0]||fd==fa[1] ? 0 : 1; }
static void ring(int fd){ if(mode==3){ int s=slot(fd), c=(seq++*7919)%CONNS; ready[s][c/64]|=1ull<<(c%64); summary[s][c/4096]|=1ull<<(c/64%64); }
 if(mode==0||mode==3){uint64_t v=1; write(fd,&v,8);} else {char c=1; write(fd,&c,1);} }
static int take(int s){ int n=0; for(int i=0;i<(CONNS/64+63)/64;i++){ uint64_t w=summary[s][i]; summary[s][i]=0; while(w){ int j=i*64+__builtin_ctzll(w); w&=w-1; uint64_t b=ready[s][j]; ready[s][j]=0; n+=__builtin_popcountll(b);} } return n; }
static void waitd(int fd){ struct pollfd p={fd,POLLIN,0}; poll(&p,1,-1); char b[64]; read(fd,b,mode==0||mode==3?8:64); if(mode==3&&take(slot(fd))!=1) abort(); }
static void busy(){ volatile double x=0; for(int i=0;i<3000;i++) x+=i; } // ~work after wake
static void* peer(void*x){ for(int i=0;i<N;i++){ waitd(fa[1]); if(sched_getcpu()==waker_cpu) same++; waker_cpu=sched_getcpu(); ring(fb[0]); busy(); } return 0; }
int main(int argc,char**argv){ mode=atoi(argv[1]);
 if(mode==0||mode==3){ fa[0]=fa[1]=eventfd(0,EFD_NONBLOCK); fb[0]=fb[1]=eventfd(0,EFD_NONBLOCK);} else if(mode==2){ pipe2(fa,O_NONBLOCK); pipe2(fb,O_NONBLOCK); int t=fa[0]; fa[0]=fa[1]; fa[1]=t; t=fb[0]; fb[0]=fb[1]; fb[1]=t; } else { socketpair(AF_UNIX,SOCK_SEQPACKET|SOCK_NONBLOCK,0,fa); socketpair(AF_UNIX,SOCK_SEQPACKET|SOCK_NONBLOCK,0,fb); int t=fb[0]; fb[0]=fb[1]; fb[1]=t; }
 pthread_t th; pthread_create(&th,0,peer,0); int same_main=0;
 double t0=now(); for(int i=0;i<N;i++){ waker_cpu=sched_getcpu(); ring(fa[0]); busy(); waitd(fb[1]); if(sched_getcpu()==waker_cpu) same_main++; } double t1=now(); pthread_join(th,0);
 printf("mode %s: round trip %.1f us, wakee on the waker's CPU: peer %.0f%%, main %.0f%%\n", (const char*[]){"eventfd","seqpacket","pipe","eventfd+bitmap"}[mode],(t1-t0)/N/1000, 100.0*same/N, 100.0*same_main/N);
}
