/* crc_copy.c - thread CPU per GB of copying cold blocks (a bounce buffer after DMA) into
 * slots: copy only, CRC32C then copy (the bounce's order: nothing reaches the slot before
 * it checks), and CRC fused with the copy chunk by chunk. 9 interleaved rounds, medians.
 *   cd mptier/native && gcc -O2 -I. -o /tmp/crc_copy ../../bench/experiments/crc_copy.c crc32c.c -lpthread
 *   /tmp/crc_copy 2097152 65536 */
#define _GNU_SOURCE
#include "mptier_native.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
static double cpu(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t bb=atol(argv[1]); size_t nb=(256u<<20)/bb; size_t ch=atol(argv[2]);
  char *src=mmap(0,64<<20,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS|MAP_POPULATE,-1,0);
  char *dst=mmap(0,256<<20,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS|MAP_POPULATE,-1,0);
  char *evict=malloc(64<<20);
  for(size_t i=0;i<(64u<<20);i++)src[i]=i*13;
  double r[3][9]; uint32_t acc=0;
  for(int round=0;round<9;round++) for(int m=0;m<3;m++){
    double t=0;
    for(size_t b=0;b<nb;b++){
      char*s=src+(b%(64*1048576/bb))*bb, *d=dst+b*bb;
      if(b%8==0){memset(evict,b,64<<20);} /* cold source, as after DMA */
      double c0=cpu();
      if(m==0){memcpy(d,s,bb);}
      else if(m==1){acc^=mpt_crc32c(0,s,bb,MPT_CRC32C_BEST);memcpy(d,s,bb);}
      else {uint32_t c=0;for(size_t o=0;o<bb;o+=ch){c=mpt_crc32c(c,s+o,ch,MPT_CRC32C_BEST);memcpy(d+o,s+o,ch);}acc^=c;}
      t+=cpu()-c0;
    }
    r[m][round]=t/(nb*bb/1e9);
  }
  const char*nm[]={"copy only","crc then copy","fused chunks"};
  for(int m=0;m<3;m++){double v[9];memcpy(v,r[m],sizeof v);for(int i=0;i<9;i++)for(int k=i+1;k<9;k++)if(v[k]<v[i]){double x=v[i];v[i]=v[k];v[k]=x;}
    printf("bb %zu ch %zu %-14s median %.3f s/GB  (q1 %.3f q3 %.3f)\n",bb,ch,nm[m],v[4],v[2],v[6]);}
  return acc==12345;
}
