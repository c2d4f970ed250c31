// AMX (Advanced Matrix Extensions) helpers shared by moestream's CPU kernels: the tile
// configuration and the Linux permission to use the tile registers.
//
// TDPBF16PS (`_tile_dpbf16ps(c, a, b)`): C [m, n] float32 += A [m, 2k] bf16 . B, with B held in
// pairs: row k of B is (B[2k][j], B[2k + 1][j]) for j = 0..n-1 side by side (oneDNN's VNNI
// layout for bf16). A tile is at most 16 rows of 64 bytes: A 16 x 32 bf16, B 16 pairs x 16
// columns, C 16 x 16 float32. Each output adds its k pairs in order from the first, so a
// row's result depends only on its own values, whatever the other rows in the tile.
//
// Source: Intel's Architecture Instruction Set Extensions Programming Reference, chapter 3
// (AMX); the Linux kernel's Documentation/arch/x86/xstate.rst (ARCH_REQ_XCOMP_PERM).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace moestream_amx {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define MOESTREAM_AMX 1

// The 64-byte operand of LDTILECFG: palette 1, then bytes per row and rows of each tile.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Asks Linux once per process for the tile data state (ARCH_REQ_XCOMP_PERM = 0x1023 for
// XFEATURE_XTILEDATA = 18): without it the first tile instruction kills the process with
// SIGILL. True when granted (or already granted, as torch's oneDNN does on first AMX use).
inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Loads a configuration (per thread) of tiles given as {index, rows, bytes per row}.
struct TileShape {
  int index, rows, colsb;
};
template <int N>
inline void configure(const TileShape (&tiles)[N]) {
  TileConfig cfg;
  for (const TileShape& t : tiles) {
    cfg.rows[t.index] = static_cast<uint8_t>(t.rows);
    cfg.colsb[t.index] = static_cast<uint16_t>(t.colsb);
  }
  _tile_loadconfig(&cfg);
}
#endif

// Whether this build has AMX-BF16 and the process may use it.
inline bool available() {
#if defined(MOESTREAM_AMX)
  return permitted();
#else
  return false;
#endif
}

}  // namespace moestream_amx
