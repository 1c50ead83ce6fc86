//! Causal attention with grouped-query heads: flash attention with the online softmax.

use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::MAX_CUBES;
use crate::AttentionOptions;

/// Keys scored per step of the attention kernel (one per unit).
const ATTN_KEYS: u32 = 32;

/// Flash attention, one cube per (query row, head, batch): the units score ATTN_KEYS keys at a
/// time, and the row keeps a running max and sum (online softmax), so memory is O(head_dim)
/// whatever the sequence length. Query head `h` reads K/V head `h / (heads / kv_heads)`.
/// Only the keys the row may see are visited: up to its position, and within the sliding window.
/// A running max of -3e38 stands for "no key yet" (WGSL has no infinity literals).
#[cube(launch)]
fn attention_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    scale: f32,
    softcap: f32,
    q_offset: u32,
    window: u32,
    #[comptime] head_dim: u32,
    #[define(F)] _dtype: StorageType,
) {
    let keys = ATTN_KEYS as usize;
    let hd = head_dim as usize;
    let i = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let lane = UNIT_POS_X as usize;
    let group = q.shape(1) / k.shape(1);
    let hk = h / group;
    let tk = k.shape(2);

    let mut q_sm = SharedMemory::<f32>::new(head_dim as usize);
    let mut acc = SharedMemory::<f32>::new(head_dim as usize);
    let mut scores = SharedMemory::<f32>::new(ATTN_KEYS as usize);
    let mut probs = SharedMemory::<f32>::new(ATTN_KEYS as usize);

    let q_base = b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
    let mut e = lane;
    while e < hd {
        q_sm[e] = f32::cast_from(q[q_base + e * q.stride(3)]);
        acc[e] = 0.0;
        e += keys;
    }
    sync_cube();

    // Keys j with first <= j < last are visible to this row.
    let pos = i + q_offset as usize;
    let mut last = pos + 1;
    if last > tk {
        last = tk;
    }
    let mut first = 0usize;
    if window > 0 && pos + 1 > window as usize {
        first = pos + 1 - window as usize;
    }
    let k_base = b * k.stride(0) + hk * k.stride(1);
    let v_base = b * v.stride(0) + hk * v.stride(1);

    let mut run_max = f32::new(-3.0e38);
    let mut run_sum = 0.0f32;
    let mut j0 = first;
    while j0 < last {
        // Score this unit's key.
        let j = j0 + lane;
        let visible = j < last;
        let mut s = f32::new(-3.0e38);
        if visible {
            let row = k_base + j * k.stride(2);
            let mut dot = 0.0f32;
            for d in 0..hd {
                dot += q_sm[d] * f32::cast_from(k[row + d * k.stride(3)]);
            }
            s = dot * scale;
            if softcap > 0.0 {
                s = softcap * (s / softcap).tanh();
            }
        }
        scores[lane] = s;
        sync_cube();

        // Online softmax: every unit computes the same max, correction and sum.
        let mut tile_max = f32::new(-3.0e38);
        for u in 0..keys {
            let su = scores[u];
            if su > tile_max {
                tile_max = su;
            }
        }
        let mut new_max = run_max;
        if tile_max > new_max {
            new_max = tile_max;
        }
        let correction = (run_max - new_max).exp();
        let mut p = 0.0f32;
        if visible {
            p = (s - new_max).exp();
        }
        probs[lane] = p;
        sync_cube();
        let mut tile_sum = 0.0f32;
        for u in 0..keys {
            tile_sum += probs[u];
        }
        run_sum = run_sum * correction + tile_sum;
        run_max = new_max;

        // This unit's output dims: acc = acc * correction + Σ p_j v_j.
        let mut e = lane;
        while e < hd {
            let mut sum = 0.0f32;
            for u in 0..keys {
                let j = j0 + u;
                if j < last {
                    sum += probs[u] * f32::cast_from(v[v_base + j * v.stride(2) + e * v.stride(3)]);
                }
            }
            acc[e] = acc[e] * correction + sum;
            e += keys;
        }
        sync_cube();
        j0 += keys;
    }

    let o_base = b * out.stride(0) + h * out.stride(1) + i * out.stride(2);
    let mut e = lane;
    while e < hd {
        out[o_base + e * out.stride(3)] = F::cast_from(acc[e] / run_sum);
        e += keys;
    }
}

/// Flash attention for many query rows (prefill, training): a cube takes `rows` consecutive
/// query rows of one head and walks the keys in tiles of `keys`, staging each K and V tile in
/// shared memory once for all its rows. Unit (u, r) scores key u for row r; every unit of row r
/// keeps the same running max and sum (online softmax) and owns the output dims
/// `u, u + keys, …` of its row.
#[cube(launch)]
fn attention_tiled_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    scale: f32,
    softcap: f32,
    q_offset: u32,
    window: u32,
    #[comptime] head_dim: u32,
    #[comptime] keys: u32,
    #[comptime] rows: u32,
    #[define(F)] _dtype: StorageType,
) {
    let hd = head_dim as usize;
    let kn = keys as usize;
    let rn = rows as usize;
    let u = UNIT_POS_X as usize;
    let r = UNIT_POS_Y as usize;
    let unit = r * kn + u;
    let units = kn * rn;
    let i0 = CUBE_POS_X as usize * rn;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let tq = q.shape(2);
    let tk = k.shape(2);
    let group = q.shape(1) / k.shape(1);
    let hk = h / group;

    let mut q_sm = SharedMemory::<f32>::new(head_dim as usize * rows as usize);
    let mut acc = SharedMemory::<f32>::new(head_dim as usize * rows as usize);
    let mut k_sm = SharedMemory::<f32>::new(head_dim as usize * keys as usize);
    let mut v_sm = SharedMemory::<f32>::new(head_dim as usize * keys as usize);
    let mut probs = SharedMemory::<f32>::new(keys as usize * rows as usize);

    // Stage the rows' queries (zeros past the end) and clear the accumulators.
    let mut idx = unit;
    while idx < rn * hd {
        let rr = idx / hd;
        let e = idx % hd;
        let i = i0 + rr;
        let mut val = 0.0f32;
        if i < tq {
            val = f32::cast_from(
                q[b * q.stride(0) + h * q.stride(1) + i * q.stride(2) + e * q.stride(3)],
            );
        }
        q_sm[idx] = val;
        acc[idx] = 0.0;
        idx += units;
    }

    // This row's visible keys, and the span of keys any row of the cube sees.
    let i = i0 + r;
    let pos = i + q_offset as usize;
    let mut first_own = 0usize;
    if window > 0 && pos + 1 > window as usize {
        first_own = pos + 1 - window as usize;
    }
    let mut last_row = i0 + rn;
    if last_row > tq {
        last_row = tq;
    }
    let mut span_end = last_row - 1 + q_offset as usize + 1;
    if span_end > tk {
        span_end = tk;
    }
    let mut span_start = 0usize;
    if window > 0 && i0 + q_offset as usize + 1 > window as usize {
        span_start = i0 + q_offset as usize + 1 - window as usize;
    }
    let k_base = b * k.stride(0) + hk * k.stride(1);
    let v_base = b * v.stride(0) + hk * v.stride(1);
    sync_cube();

    let mut run_max = f32::new(-3.0e38);
    let mut run_sum = 0.0f32;
    let mut j0 = span_start;
    while j0 < span_end {
        // Stage K and V rows j0 .. j0 + keys (zeros past the end).
        let mut idx = unit;
        while idx < kn * hd {
            let jj = idx / hd;
            let e = idx % hd;
            let j = j0 + jj;
            let mut kv = 0.0f32;
            let mut vv = 0.0f32;
            if j < tk {
                kv = f32::cast_from(k[k_base + j * k.stride(2) + e * k.stride(3)]);
                vv = f32::cast_from(v[v_base + j * v.stride(2) + e * v.stride(3)]);
            }
            k_sm[idx] = kv;
            v_sm[idx] = vv;
            idx += units;
        }
        sync_cube();

        let j = j0 + u;
        let visible = i < tq && j < tk && j <= pos && j >= first_own;
        let mut s = f32::new(-3.0e38);
        if visible {
            let mut dot = 0.0f32;
            for e in 0..hd {
                dot += q_sm[r * hd + e] * k_sm[u * hd + e];
            }
            s = dot * scale;
            if softcap > 0.0 {
                s = softcap * (s / softcap).tanh();
            }
        }
        probs[r * kn + u] = s;
        sync_cube();
        let mut tile_max = f32::new(-3.0e38);
        for uu in 0..kn {
            let su = probs[r * kn + uu];
            if su > tile_max {
                tile_max = su;
            }
        }
        sync_cube();
        let mut new_max = run_max;
        if tile_max > new_max {
            new_max = tile_max;
        }
        let correction = (run_max - new_max).exp();
        let mut p = 0.0f32;
        if visible {
            p = (s - new_max).exp();
        }
        probs[r * kn + u] = p;
        sync_cube();
        let mut tile_sum = 0.0f32;
        for uu in 0..kn {
            tile_sum += probs[r * kn + uu];
        }
        run_sum = run_sum * correction + tile_sum;
        run_max = new_max;
        let mut e = u;
        while e < hd {
            let mut sum = 0.0f32;
            for uu in 0..kn {
                sum += probs[r * kn + uu] * v_sm[uu * hd + e];
            }
            acc[r * hd + e] = acc[r * hd + e] * correction + sum;
            e += kn;
        }
        sync_cube();
        j0 += kn;
    }

    if i < tq {
        let o_base = b * out.stride(0) + h * out.stride(1) + i * out.stride(2);
        let mut e = u;
        while e < hd {
            out[o_base + e * out.stride(3)] = F::cast_from(acc[r * hd + e] / run_sum);
            e += kn;
        }
    }
}

pub(super) fn attention<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    options: AttentionOptions,
) -> CubeTensor<R> {
    let [b, h, tq, d] = q.shape().dims::<4>();
    let out = empty_device_contiguous_dtype(q.client.clone(), q.device.clone(), q.shape(), q.dtype);
    let (scale, softcap) = (options.scale, options.softcap.unwrap_or(0.0));
    let q_offset = options.q_offset as u32;
    let window = options.window.map_or(0, |w| w as u32);
    // Tiles for many rows: 16 keys × 8 rows, or 8 × 4 for heads wider than 128, when the
    // staged Q, K, V and accumulators fit the device's shared memory.
    let (keys, rows) = if d <= 128 { (16u32, 8u32) } else { (8, 4) };
    let shared_bytes = 4 * (2 * d * (keys + rows) as usize + (keys * rows) as usize);
    let max_shared = q.client.properties().hardware.max_shared_memory_size;
    if tq >= 2 * rows as usize && shared_bytes <= max_shared {
        let tiles = tq.div_ceil(rows as usize);
        assert!(
            tiles <= MAX_CUBES && h <= MAX_CUBES && b <= MAX_CUBES,
            "attention grid too large"
        );
        attention_tiled_kernel::launch::<R>(
            &q.client,
            CubeCount::Static(tiles as u32, h as u32, b as u32),
            CubeDim::new_2d(keys, rows),
            q.clone().into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            scale,
            softcap,
            q_offset,
            window,
            d as u32,
            keys,
            rows,
            q.dtype.into(),
        );
    } else {
        assert!(
            tq <= MAX_CUBES && h <= MAX_CUBES && b <= MAX_CUBES,
            "attention grid too large"
        );
        attention_kernel::launch::<R>(
            &q.client,
            CubeCount::Static(tq as u32, h as u32, b as u32),
            CubeDim::new_1d(ATTN_KEYS),
            q.clone().into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            scale,
            softcap,
            q_offset,
            window,
            d as u32,
            q.dtype.into(),
        );
    }
    out
}
