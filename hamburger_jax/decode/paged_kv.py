"""The paged KV pool: one pool of fixed-size blocks shared by every decode slot, a block table
per slot, and the host-side allocator that hands blocks out and takes them back.

A slot's entry `s` lives in block `table[row, s // block_size]` at offset `s % block_size`. Block
0 is the trash block: it belongs to nobody, every unused table entry points at it, and writes
from finished or empty slots land there, so a slot can never write into another slot's blocks.
Base mode takes one entry per token, HAMburger one per macro step, so the same pool holds up to
k (tokens per step) times the requests in HAMburger mode; prompts take one entry per token in
both, so a stream's ratio is `serving.mean_blocks_held` of the base over HAMburger's.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hamburger_jax.model.kv_cache import KVCache

TRASH_BLOCK = 0


@flax.struct.dataclass
class PagedKVCache:
  k: jax.Array  # [L, NB, BS, Hkv, Dh] the pool
  v: jax.Array  # [L, NB, BS, Hkv, Dh]
  table: jax.Array  # [B, MB] int32 block ids per slot (TRASH_BLOCK where unallocated)
  length: jax.Array  # [B] int32 entries written so far

  @classmethod
  def init(cls, num_layers: int, num_blocks: int, block_size: int, batch: int,
           blocks_per_row: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32) -> "PagedKVCache":
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               table=jnp.full((batch, blocks_per_row), TRASH_BLOCK, jnp.int32),
               length=jnp.zeros((batch,), jnp.int32))

  @property
  def block_size(self) -> int:
    return self.k.shape[2]

  @property
  def slots(self) -> int:
    """Entries one row can address (its view): blocks per row x block size."""
    return self.table.shape[1] * self.block_size

  def capacity(self) -> jax.Array:
    """[B] entries each row can hold in the blocks it owns."""
    return jnp.sum(self.table != TRASH_BLOCK, axis=1) * self.block_size

  def _locate(self, slots_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    # Past the table's end reads as the trash block (a gather would clamp to the last one).
    blocks = jnp.take_along_axis(self.table, slots_bt // self.block_size, axis=1, mode="fill",
                                 fill_value=TRASH_BLOCK)
    return blocks, slots_bt % self.block_size

  def write_layers(self, slots_bt: jax.Array, k_lbthd: jax.Array,
                   v_lbthd: jax.Array, start: int = 0) -> "PagedKVCache":
    """Writes T new entries per row at per-row slots [B, T] into the rows' blocks, in every
    layer or in layers start.. (KVCache.write_layers)."""
    blocks, offsets = self._locate(slots_bt)
    dt = self.k.dtype
    layers = slice(start, start + k_lbthd.shape[0])
    return self.replace(k=self.k.at[layers, blocks, offsets].set(k_lbthd.astype(dt)),
                        v=self.v.at[layers, blocks, offsets].set(v_lbthd.astype(dt)))

  def _locate_row(self, row: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """Block and offset [size] of one row's entries 0..size-1."""
    blocks, offsets = self.replace(table=self.table[row][None])._locate(jnp.arange(size)[None])
    return blocks[0], offsets[0]

  def read_row(self, row: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """Entries 0..size-1 of one row, every layer: k, v [L, size, Hkv, Dh] (a prefix to cache)."""
    blocks, offsets = self._locate_row(row, size)
    return self.k[:, blocks, offsets], self.v[:, blocks, offsets]

  def write_row(self, row: jax.Array, k_lthd: jax.Array, v_lthd: jax.Array,
                n: jax.Array) -> "PagedKVCache":
    """Writes the first n of k, v [L, T, Hkv, Dh] as one row's entries 0..n-1, every layer;
    the rest go to the trash block."""
    t = k_lthd.shape[1]
    blocks, offsets = self._locate_row(row, t)
    blocks = jnp.where(jnp.arange(t) < n, blocks, TRASH_BLOCK)
    dt = self.k.dtype
    return self.replace(k=self.k.at[:, blocks, offsets].set(k_lthd.astype(dt)),
                        v=self.v.at[:, blocks, offsets].set(v_lthd.astype(dt)))

  def view(self) -> KVCache:
    """Every layer's entries of each row, gathered from its blocks into a dense cache
    [L, B, slots, Hkv, Dh] that a forward reads (the pool itself is then only written: read
    per layer between the writes, the pool would be copied whole to be written in place)."""
    b, m = self.table.shape
    l, _, bs, hkv, dh = self.k.shape
    gather = lambda pool: pool[:, self.table].reshape(l, b, m * bs, hkv, dh)
    return KVCache(k=gather(self.k), v=gather(self.v), length=self.length)


def blocks_for(entries: int, block_size: int) -> int:
  return -(-entries // block_size)


class BlockAllocator:
  """Host-side free list of the pool's blocks (block 0, the trash block, is never handed out).

  Lowest ids first, so allocation is deterministic."""

  def __init__(self, num_blocks: int):
    if num_blocks < 2:
      raise ValueError(f"a KV pool needs at least 2 blocks (one is the trash block), got "
                       f"{num_blocks}")
    self.num_blocks = num_blocks
    self._free = list(range(num_blocks - 1, TRASH_BLOCK, -1))  # a stack: pop() gives the lowest

  @property
  def free(self) -> int:
    return len(self._free)

  @property
  def usable(self) -> int:
    return self.num_blocks - 1

  def take(self, n: int) -> list[int]:
    if n > len(self._free):
      raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
    return [self._free.pop() for _ in range(n)]

  def give_back(self, blocks) -> None:
    blocks = [int(x) for x in blocks if int(x) != TRASH_BLOCK]
    if set(blocks) & set(self._free):
      raise RuntimeError(f"KV blocks {sorted(set(blocks) & set(self._free))} freed twice")
    self._free.extend(blocks)
    self._free.sort(reverse=True)


def row_table(blocks: list[int], blocks_per_row: int) -> np.ndarray:
  out = np.full((blocks_per_row,), TRASH_BLOCK, np.int32)
  out[:len(blocks)] = blocks
  return out
