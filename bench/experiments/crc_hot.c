/* crc_hot.c - tmpfs loads of a checksummed block, thread CPU per GB, 15 interleaved
 * rounds, medians, three ways:
 *   way 0: pread into the slot, no CRC (the copy alone);
 *   way 1: pread into the slot, then the CRC of the slot (the tier's way);
 *   way 2-6: pread a chunk of 16 KiB to 256 KiB into a small buffer kept hot in the
 *            core's cache, CRC it there, memcpy it into the slot (the CRC reads from
 *            cache, at the price of a second copy).
 *   cd mptier/native && gcc -O2 -I. -o /tmp/crc_hot ../../bench/experiments/crc_hot.c crc32c.c -lpthread
 *   mkdir /dev/shm/x && /tmp/crc_hot 262144 256 /dev/shm/x; /tmp/crc_hot 2097152 32 /dev/shm/x */
#define _GNU_SOURCE
#include "mptier_native.h"
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
static double cpu(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define NW 7
int main(int argc,char**argv){
  size_t bb=atol(argv[1]); int nfiles=atoi(argv[2]); const char*dir=argv[3];
  size_t hot[NW]={0,0,16384,32768,65536,131072,262144};
  char *dst=mmap(0,bb*nfiles,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS|MAP_POPULATE,-1,0);
  char *hb=aligned_alloc(4096, 262144); memset(hb,1,262144);
  char *src=malloc(bb); for(size_t i=0;i<bb;i++)src[i]=i*7;
  char p[256]; uint32_t acc[NW]={0};
  for(int f=0;f<nfiles;f++){snprintf(p,256,"%s/b%d",dir,f);int fd=open(p,O_CREAT|O_WRONLY|O_TRUNC,0644);write(fd,src,bb);close(fd);}
  double R[NW][15];
  for(int round=0;round<15;round++) for(int w=0;w<NW;w++){
    double c0=cpu();
    for(int f=0;f<nfiles;f++){snprintf(p,256,"%s/b%d",dir,f);int fd=open(p,O_RDONLY);
      char*d=dst+(size_t)f*bb; uint32_t crc=0;
      if(w==0) pread(fd,d,bb,0);
      else if(w==1){pread(fd,d,bb,0);crc=mpt_crc32c(0,d,bb,MPT_CRC32C_BEST);}
      else {size_t ch=hot[w]; for(size_t o=0;o<bb;o+=ch){size_t n=bb-o<ch?bb-o:ch; pread(fd,hb,n,o); crc=mpt_crc32c(crc,hb,n,MPT_CRC32C_BEST); memcpy(d+o,hb,n);}}
      acc[w]+=crc; close(fd);}
    R[w][round]=(cpu()-c0)/(bb*(double)nfiles/1e9);
  }
  for(int w=0;w<NW;w++){double*v=R[w];for(int i=0;i<15;i++)for(int k=i+1;k<15;k++)if(v[k]<v[i]){double x=v[i];v[i]=v[k];v[k]=x;}
    printf("bb %7zu way %d hot %6zu: %.3f s/GB (q1 %.3f q3 %.3f) crcsum %u\n",bb,w,hot[w],v[7],v[3],v[11],acc[w]);}
  for(int f=0;f<nfiles;f++){snprintf(p,256,"%s/b%d",dir,f);unlink(p);}
}
