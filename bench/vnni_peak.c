// The rate one core retires 512-bit `vpdpbusd` (VNNI u8 x s8 dot products, 64 multiply-adds each) and 512-bit
// FMAs when nothing else limits them: 16 independent accumulator chains, 1.6e9 instructions. The ceiling every
// integer kernel here (the interleaved matmuls, the head screen) is measured against once its rows are many.
// gcc -O2 -mavx512f -mavx512vnni -mavx512bw bench/vnni_peak.c -o /tmp/vnni_peak && /tmp/vnni_peak
// Session 59, the 2-vCPU Emerald Rapids VM: vpdpbusd 0.42-0.45 ns each (2.2-2.4 G/s, i.e. ~150 GMAC/s per
// core), FMA 0.22 ns (two per cycle); two copies at once on the two vCPUs: 0.33 and 0.42 ns (no shared port).
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  __m512i a[16]; __m512i x=_mm512_set1_epi8(3), y=_mm512_set1_epi8(5);
  for(int i=0;i<16;i++) a[i]=_mm512_set1_epi32(i);
  long N=100000000; double t=now();
  for(long n=0;n<N;n++){
    #pragma GCC unroll 16
    for(int i=0;i<16;i++) a[i]=_mm512_dpbusd_epi32(a[i],x,y);
    __asm__ volatile(""::"v"(x),"v"(y));
  }
  t=now()-t; __m512i s=a[0]; for(int i=1;i<16;i++) s=_mm512_add_epi32(s,a[i]);
  printf("dpbusd: %.3f ns per instr, %.2f G/s (sum %d)\n", t*1e9/(N*16.0), N*16.0/t/1e9, _mm512_reduce_add_epi32(s));
  // fp fma throughput
  __m512 f[16]; __m512 m=_mm512_set1_ps(1.0001f);
  for(int i=0;i<16;i++) f[i]=_mm512_set1_ps(i);
  t=now();
  for(long n=0;n<N;n++){
    #pragma GCC unroll 16
    for(int i=0;i<16;i++) f[i]=_mm512_fmadd_ps(f[i],m,m);
    __asm__ volatile(""::"v"(m));
  }
  t=now()-t; __m512 g=f[0]; for(int i=1;i<16;i++) g=_mm512_add_ps(g,f[i]);
  printf("fma: %.3f ns per instr (%f)\n", t*1e9/(N*16.0), _mm512_reduce_add_ps(g));
}
