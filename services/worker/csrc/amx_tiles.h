/* The AMX tile configuration the library's tile kernels share (gemm_amx_bf16.c, paged_decode_amx.c,
 * paged_prefill_amx.h): LDTILECFG's 64-byte block, a setter per tile, and the uniform layout of 8
 * tiles of 16 rows x 64 bytes. Included only where the compiler targets AMX. */
#ifndef SPINDLE_AMX_TILES_H
#define SPINDLE_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

int gemm_amx_available(void); /* gemm_amx_bf16.c: asks the kernel for the tile state once */

struct tile_config {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static inline void tile_config_init(struct tile_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->palette_id = 1;
}

static inline void set_tile(struct tile_config *cfg, int tile, int rows, int colsb) {
  cfg->rows[tile] = (uint8_t)rows;
  cfg->colsb[tile] = (uint16_t)colsb;
}

/* Every tile 16 rows x 64 bytes: A, B and C tiles of full bfloat16 / float32 blocks. */
static inline void load_uniform_tiles(void) {
  struct tile_config cfg;
  tile_config_init(&cfg);
  for (int t = 0; t < 8; t++) set_tile(&cfg, t, 16, 64);
  _tile_loadconfig(&cfg);
}

#endif
