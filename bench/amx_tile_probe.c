// What the AMX tile instructions cost on this CPU, per block of the specee tile kernels (16 activation rows ×
// 32 values × 16 weight rows), next to the per-block float scaling both the VNNI and the tile kernels do.
// Build and run (Linux, a CPU with AMX-INT8):
//   gcc -O2 -mamx-tile -mamx-int8 -mavx512f -mavx512bw bench/amx_tile_probe.c -o /tmp/amx_probe && /tmp/amx_probe
// Prints ns per block for: the tile instructions alone (zero, load A, load B, product, store), each of them
// alone, the scaling alone, and the two together in the order crates/kernels/src/kernel/amx.rs uses (the sums
// stored after the previous block's scaling) and in the naive order (stored right after the product).
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define M 16
typedef struct { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static uint8_t acts[17 * 4096 + 64 * 1024] __attribute__((aligned(64)));
static uint8_t wb[2][512] __attribute__((aligned(64)));
static int32_t sums[2][256] __attribute__((aligned(64)));
static float dx[4096], sx[4096];

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
// The per-block scaling of one activation row tile: acc += f32(sum) · (d_w · d_x) + m_w · s_x (Q4_1).
static inline void scale(int s, __m512 *acc) {
  __m512 dw = _mm512_set1_ps(1.01f), cw = _mm512_set1_ps(0.7f);
  for (int j = 0; j < M; j++) {
    __m512i v = _mm512_load_si512(&sums[s][16 * j]);
    __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(dx[j * 18 + s]));
    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), sc, acc[j]);
    acc[j] = _mm512_fmadd_ps(cw, _mm512_set1_ps(sx[j * 18 + s]), acc[j]);
  }
}
// The weight tile of a block from packed nibbles (as the Q4 tile kernels build it).
static inline void unpack(int s, int b) {
  for (int k = 0; k < 4; k++) {
    __m512i p = _mm512_loadu_si512(acts + 64 * k + b);
    _mm512_store_si512(wb[s] + 64 * k, _mm512_and_si512(p, _mm512_set1_epi8(15)));
    _mm512_store_si512(wb[s] + 256 + 64 * k, _mm512_and_si512(_mm512_srli_epi16(p, 4), _mm512_set1_epi8(15)));
  }
}
#define REPORT(name) printf("%-44s %6.1f ns per block\n", name, (now() - t0) / n * 1e9)

int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    puts("the kernel refused the AMX tile state");
    return 1;
  }
  cfg_t c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 6; i++) c.colsb[i] = 64, c.rows[i] = M;
  c.colsb[1] = c.colsb[4] = 32;
  c.rows[2] = c.rows[5] = 8;
  _tile_loadconfig(&c);
  long n = 2000000;
  __m512 acc[M];
  for (int j = 0; j < M; j++) acc[j] = _mm512_setzero_ps();
  double t0 = now();
  for (long i = 0; i < n; i += 2) {
    int b = i % 512;
    _tile_zero(0); _tile_loadd(1, acts + 32 * b, 4096); _tile_loadd(2, wb[0], 64); _tile_dpbssd(0, 1, 2);
    _tile_stored(0, sums[0], 64);
    _tile_zero(3); _tile_loadd(4, acts + 32 * b + 32, 4096); _tile_loadd(5, wb[1], 64); _tile_dpbssd(3, 4, 5);
    _tile_stored(3, sums[1], 64);
  }
  REPORT("tile instructions (two blocks in flight)");
  t0 = now();
  for (long i = 0; i < n; i += 2) { int b = i % 512; _tile_loadd(1, acts + 32 * b, 4096); _tile_loadd(4, acts + 32 * b + 32, 4096); }
  REPORT("  activation tile loads");
  t0 = now();
  for (long i = 0; i < n; i += 2) { _tile_stored(0, sums[0], 64); _tile_stored(3, sums[1], 64); }
  REPORT("  sum tile stores");
  t0 = now();
  for (long i = 0; i < n; i += 2) { _tile_dpbssd(0, 1, 2); _tile_dpbssd(3, 4, 5); }
  REPORT("  tile products");
  t0 = now();
  for (long i = 0; i < n; i += 2) { int b = i % 512; unpack(0, b); scale(0, acc); unpack(1, b); scale(1, acc); }
  REPORT("weight unpacking + scaling (no tiles)");
  t0 = now();
  for (long i = 0; i < n; i += 2) {
    int b = i % 512;
    _tile_zero(3); _tile_loadd(4, acts + 32 * b + 32, 4096); _tile_loadd(5, wb[1], 64); _tile_dpbssd(3, 4, 5);
    _tile_stored(3, sums[1], 64);
    unpack(0, b); scale(0, acc);
    _tile_zero(0); _tile_loadd(1, acts + 32 * b + 64, 4096); _tile_loadd(2, wb[0], 64); _tile_dpbssd(0, 1, 2);
    _tile_stored(0, sums[0], 64);
    unpack(1, b); scale(1, acc);
  }
  REPORT("all, sums stored right after the product");
  t0 = now();
  for (long i = 0; i < n; i += 2) {
    int b = i % 512;
    _tile_zero(3); _tile_loadd(4, acts + 32 * b + 32, 4096); _tile_loadd(5, wb[1], 64); _tile_dpbssd(3, 4, 5);
    unpack(0, b); scale(0, acc);
    _tile_stored(3, sums[1], 64);
    _tile_zero(0); _tile_loadd(1, acts + 32 * b + 64, 4096); _tile_loadd(2, wb[0], 64); _tile_dpbssd(0, 1, 2);
    unpack(1, b); scale(1, acc);
    _tile_stored(0, sums[0], 64);
  }
  REPORT("all, sums stored after the previous scaling");
  float f[16];
  _mm512_storeu_ps(f, acc[0]);
  _tile_release();
  return f[0] != 0.0f;  // keeps the scaling live
}
