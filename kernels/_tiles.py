"""Tile helpers shared by the kernels (masked row loads, partial-softmax stores)."""
import triton
import triton.language as tl


@triton.jit
def load_rows(ptr, rows, row_ok, rd, D):
    """Rows `rows` (masked by row_ok) of a [*, D] row-major table as an fp32 tile [R, BD]."""
    return tl.load(ptr + rows[:, None] * D + rd[None, :], mask=row_ok[:, None] & (rd[None, :] < D),
                   other=0.0).to(tl.float32)


@triton.jit
def store_partial(m_ptr, l_ptr, acc_ptr, rows, row_ok, rd, D, m_i, l_i, acc):
    tl.store(m_ptr + rows, m_i, mask=row_ok)
    tl.store(l_ptr + rows, l_i, mask=row_ok)
    tl.store(acc_ptr + rows[:, None] * D + rd[None, :], acc, mask=row_ok[:, None] & (rd[None, :] < D))
