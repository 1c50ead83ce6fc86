//! A continuous-batching pass's activation rows as the sequences they belong to.
//!
//! llama.cpp's CPU backend picks a matmul kernel by the number of activation rows (Q4_K's 4-row
//! `gemm` beside its 1-row `gemv`, the tiled kernel from 8 rows of the other K-quants,
//! tinyBLAS from 2 rows of F32, F16, BF16 and IQ4_NL), and each kernel sums in its own order.
//! A pass that carries several sequences' rows would give each row the kernel of the whole
//! pass's row count — other numbers than the sequence gets alone. Declared groups
//! ([`crate::ToyBackend::with_row_groups`]) let each matmul give every row the kernel its own
//! sequence's row count picks, so batching changes no sequence's logits.
//!
//! The declaration is a thread-local scope (carried into `run_pass`'s worker), read by the
//! matmuls whose row count is the groups' sum; one whose row count differs (a MoE expert's
//! gathered rows) computes as usual.

use std::cell::RefCell;

thread_local! {
    static ROW_GROUPS: RefCell<Option<Vec<usize>>> = const { RefCell::new(None) };
}

/// Restores the previous declaration when dropped (on return and on unwind).
struct Restore(Option<Vec<usize>>);

impl Drop for Restore {
    fn drop(&mut self) {
        let previous = self.0.take();
        ROW_GROUPS.with(|g| *g.borrow_mut() = previous);
    }
}

/// Run `f` with `groups` (or none) declared on this thread.
pub(super) fn scoped<R>(groups: Option<Vec<usize>>, f: impl FnOnce() -> R) -> R {
    let previous = ROW_GROUPS.with(|g| std::mem::replace(&mut *g.borrow_mut(), groups));
    let _restore = Restore(previous);
    f()
}

/// This thread's declaration, to carry into another thread's scope.
pub(super) fn current() -> Option<Vec<usize>> {
    ROW_GROUPS.with(|g| g.borrow().clone())
}

/// The declared groups of a matmul of `m` rows: `None` where nothing is declared, where one
/// group holds every row (the kernels' usual choice is that sequence's), or where the groups
/// do not add up to `m`.
pub(super) fn for_rows(m: usize) -> Option<Vec<usize>> {
    ROW_GROUPS.with(|g| {
        let g = g.borrow();
        let groups = g.as_ref()?;
        (groups.len() > 1 && groups.iter().sum::<usize>() == m).then(|| groups.clone())
    })
}

/// For each row, its index within its group and its group's length.
pub(super) fn positions(groups: &[usize]) -> impl Iterator<Item = (usize, usize)> + '_ {
    groups
        .iter()
        .flat_map(|&len| (0..len).map(move |j| (j, len)))
}

/// `x[m, k] · Wᵀ` (`n` outputs per row) for a kernel chosen by row count only between one row
/// and several: the rows of one-row groups go through `one_row` together (its numbers per row
/// are those of one row alone), each longer group through `several` on its own rows, and
/// the outputs come back in row order.
pub(super) fn split_single_rows(
    x: &[f32],
    k: usize,
    n: usize,
    groups: &[usize],
    one_row: impl Fn(&[f32], usize) -> Vec<f32>,
    several: impl Fn(&[f32], usize) -> Vec<f32>,
) -> Vec<f32> {
    let m: usize = groups.iter().sum();
    let mut out = vec![0.0f32; m * n];
    let mut singles = Vec::new();
    let mut single_rows = Vec::new();
    let mut row = 0;
    for &len in groups {
        if len == 1 {
            singles.extend_from_slice(&x[row * k..(row + 1) * k]);
            single_rows.push(row);
        } else if len > 1 {
            let y = several(&x[row * k..(row + len) * k], len);
            out[row * n..(row + len) * n].copy_from_slice(&y);
        }
        row += len;
    }
    if !single_rows.is_empty() {
        let y = one_row(&singles, single_rows.len());
        for (i, &r) in single_rows.iter().enumerate() {
            out[r * n..(r + 1) * n].copy_from_slice(&y[i * n..(i + 1) * n]);
        }
    }
    out
}
