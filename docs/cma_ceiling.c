/* The ceiling of cross-memory attach on this machine: process_vm_readv of SIZE bytes
 * from a forked child, against memcpy of the same size. See docs/PERFORMANCE.md.
 * gcc -O2 docs/cma_ceiling.c -o /tmp/cma && /tmp/cma [SIZE] [huge] */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#include <time.h>
#include <signal.h>
#include <sys/mman.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t sz = argc>1? atol(argv[1]) : 1<<20; int huge = argc>2;
  char *src = mmap(0, sz, PROT_READ|PROT_WRITE, MAP_SHARED|MAP_ANONYMOUS, -1, 0);
  if (huge) madvise(src, sz, MADV_HUGEPAGE);
  memset(src, 1, sz);
  pid_t p = fork();
  if (!p) { for(;;) pause(); }
  char *dst = mmap(0, sz, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
  if (huge) madvise(dst, sz, MADV_HUGEPAGE);
  memset(dst, 0, sz);
  int n = (int)(2e9/sz); if(n<10)n=10;
  for (int r=0;r<3;r++){
  double t=now();
  for (int i=0;i<n;i++){ struct iovec l={dst,sz}, rr={src,sz}; if(process_vm_readv(p,&l,1,&rr,1,0)!=sz){perror("r");return 1;} }
  double dt=now()-t; printf("cma %zu: %.2f GB/s\n", sz, n*sz/dt/1e9);
  t=now(); for (int i=0;i<n;i++){ memcpy(dst,src,sz); __asm__ volatile("":::"memory"); } dt=now()-t; printf("memcpy %zu: %.2f GB/s\n", sz, n*sz/dt/1e9);
  }
  kill(p,9); return 0; }
