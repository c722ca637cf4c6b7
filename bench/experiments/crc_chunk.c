/* crc_chunk.c - thread CPU per GB of reading tmpfs files into memory in chunks of 16 KiB
 * to a whole block, each chunk CRC32C'd right after its read (as the tier's buffered
 * loads do), against reading without a CRC (chunk 0). 15 interleaved rounds, medians.
 *   cd mptier/native && gcc -O2 -I. -o /tmp/crc_chunk ../../bench/experiments/crc_chunk.c crc32c.c -lpthread
 *   mkdir /dev/shm/x && /tmp/crc_chunk 2097152 64 /dev/shm/x */
#define _GNU_SOURCE
#include "mptier_native.h"
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static double cpu(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t bb=atol(argv[1]); int nfiles=atoi(argv[2]); const char*dir=argv[3];
  size_t chunks[]={0,16384,32768,65536,131072,262144,bb};
  char *dst=mmap(0,bb*nfiles,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS|MAP_POPULATE,-1,0);
  char *src=malloc(bb); for(size_t i=0;i<bb;i++)src[i]=i*7;
  char p[256];
  for(int f=0;f<nfiles;f++){snprintf(p,256,"%s/b%d",dir,f);int fd=open(p,O_CREAT|O_WRONLY|O_TRUNC,0644);write(fd,src,bb);close(fd);}
  double R[7][15];for(int round=0;round<15;round++) for(int c=0;c<7;c++){
    size_t ch=chunks[c]; double t0=now(),c0=cpu(); uint32_t acc=0;
    for(int f=0;f<nfiles;f++){snprintf(p,256,"%s/b%d",dir,f);int fd=open(p,O_RDONLY);
      char*d=dst+(size_t)f*bb;
      if(ch==0){pread(fd,d,bb,0);} else {uint32_t crc=0; for(size_t o=0;o<bb;o+=ch){pread(fd,d+o,ch,o);crc=mpt_crc32c(crc,d+o,ch,MPT_CRC32C_BEST);} acc^=crc;}
      close(fd);}
    double w=now()-t0,cp=cpu()-c0;
    R[c][round]=cp/(bb*(double)nfiles/1e9);(void)w;
  }
  for(int c=0;c<7;c++){double*v=R[c];for(int i=0;i<15;i++)for(int k=i+1;k<15;k++)if(v[k]<v[i]){double x=v[i];v[i]=v[k];v[k]=x;} printf("bb %zu chunk %7zu cpu median %.3f s/GB (q1 %.3f q3 %.3f)\n",bb,chunks[c],v[7],v[3],v[11]);}
  for(int f=0;f<nfiles;f++){snprintf(p,256,"%s/b%d",dir,f);unlink(p);}
}
