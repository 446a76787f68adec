/* Repacking int4 codes from another tool's int32 words into the artifact's tiles.
 *
 * Every 4-bit format packs the same codes; they differ only in which word and which nibble
 * hold element (k, n). The caller describes that with a table for one 16 x 16 tile: for
 * nibble p of destination word t, the source word's offset from the tile's first word and the
 * bit shift of the code in it. The offsets of tile (kt, nt) are the table's plus
 * kt * tile_k_stride + nt * tile_n_stride, which holds for every format here because each
 * packs whole runs of 8 along k or n and a tile spans 16 of both.
 *
 * One pass that reads each source word 8 times from cache and writes each destination word
 * once: the torch formulation (unpack to bytes, a 10-axis permute, repack) moves the codes
 * through memory five times and is most of a conversion's time.
 */
#include <stdint.h>

#define TILE_WORDS 32
#define NIBBLES 8

void repack_tiles(const int32_t *src, int32_t *dst, int64_t tiles_k, int64_t tiles_n,
                  int64_t tile_k_stride, int64_t tile_n_stride, int64_t dst_row_stride,
                  const int64_t *offset, const int32_t *shift) {
#pragma omp parallel for schedule(static)
    for (int64_t kt = 0; kt < tiles_k; kt++) {
        int32_t *row = dst + kt * dst_row_stride;
        for (int64_t nt = 0; nt < tiles_n; nt++) {
            const int32_t *base = src + kt * tile_k_stride + nt * tile_n_stride;
            for (int t = 0; t < TILE_WORDS; t++) {
                uint32_t word = 0;
                for (int p = 0; p < NIBBLES; p++) {
                    int i = t * NIBBLES + p;
                    uint32_t code = ((uint32_t)base[offset[i]] >> shift[i]) & 0xFu;
                    word |= code << (4 * p);
                }
                row[TILE_WORDS * nt + t] = (int32_t)word;
            }
        }
    }
}
