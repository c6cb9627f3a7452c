"""The gated delta rule in chunks, for training qwen3_next.

mlx-lm runs the linear-attention recurrence of Qwen3-Next one token at a
time outside its Metal kernel: for a training step that keeps every
token's [Dv, Dk] state per head for the backward, which ran the H200 out
of memory at the `small` preset. Here the sequence is cut into chunks of
``CHUNK`` tokens. Within a chunk the delta rule is solved in closed form
(the WY form of Gated DeltaNet: matrix products only), and the state is
carried from chunk to chunk: T / CHUNK sequential steps and states instead
of T. The math is the recurrence's, rounded differently (tested against
mlx-lm's ``gated_delta_ops``). Inference never uses it: a trained folder
runs on mlx-lm's own code.

Per head, with S mapping keys to values, the recurrence is

    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,    y_t = S_t q_t.

In a chunk starting from S_0, with gamma_t the product of the g's up to t,
S_t = gamma_t S_0 + sum_{i<=t} (gamma_t / gamma_i) w_i k_i^T where the
w's solve the unit lower-triangular system

    (I + A) W = diag(beta) V - diag(beta gamma) K S_0^T,
    A_ti = beta_t (gamma_t / gamma_i) (k_t . k_i)   (i < t),

whose inverse is the finite series (I - A)(I + A^2)(I + A^4)... (A is
nilpotent). Keys are unit vectors and beta, gamma_t / gamma_i <= 1, so with
16-token chunks the series' terms stay small in float32.
"""

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

CHUNK = 16


def chunked(q, k, v, log_g, beta, state):
    """(y, final state) of the gated delta rule over a sequence.

    q, k: [B, T, H, Dk] (heads already repeated to v's); v: [B, T, H, Dv];
    log_g, beta: [B, T, H]; state: [B, H, Dv, Dk]. Computed in float32."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    C = CHUNK
    pad = (-T) % C
    f32 = mx.float32
    q, k, v, log_g, beta = (x.astype(f32) for x in (q, k, v, log_g, beta))
    if pad:  # padded steps keep the state (g = 1, beta = 0) and read nothing
        q, k, v, log_g, beta = (mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                                for x in (q, k, v, log_g, beta))
    N = (T + pad) // C

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.reshape(B, N, C, H, *x.shape[3:])
        return mx.moveaxis(x, 3, 1)

    q, k, v, log_g, beta = map(chunks, (q, k, v, log_g, beta))
    lg = mx.cumsum(log_g, axis=-1)  # log gamma, [B, H, N, C]
    gamma = mx.exp(lg)
    upto = mx.tril(mx.ones((C, C), dtype=mx.bool_))  # i <= t
    # gamma_t / gamma_i where i <= t, else 0
    decay = mx.exp(mx.where(upto, lg[..., :, None] - lg[..., None, :], -mx.inf))
    before = decay * (1 - mx.eye(C))  # i < t

    A = beta[..., None] * (k @ mx.swapaxes(k, -1, -2)) * before
    eye = mx.eye(C)
    inv, power, n = eye - A, A, 2
    while n < C:
        power = power @ power
        inv = inv @ (eye + power)
        n *= 2
    u = inv @ (beta[..., None] * v)  # [B, H, N, C, Dv]
    kt = inv @ ((beta * gamma)[..., None] * k)  # [B, H, N, C, Dk]
    qk = (q @ mx.swapaxes(k, -1, -2)) * decay
    qg = gamma[..., None] * q
    last = gamma[..., -1]  # [B, H, N]
    k_end = mx.exp(lg[..., -1:] - lg)[..., None] * k  # (gamma_C / gamma_i) k_i

    S = state.astype(f32)
    ys = []
    for c in range(N):
        St = mx.swapaxes(S, -1, -2)  # [B, H, Dk, Dv]
        w = u[:, :, c] - kt[:, :, c] @ St
        ys.append(qg[:, :, c] @ St + qk[:, :, c] @ w)
        S = last[:, :, c, None, None] * S + mx.swapaxes(w, -1, -2) @ k_end[:, :, c]
    y = mx.stack(ys, axis=2)  # [B, H, N, C, Dv]
    y = mx.moveaxis(y, 1, 3).reshape(B, N * C, H, Dv)
    return y[:, :T], S


def update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
           lower_bound=None, allow_neg_eigval=False):
    """``mlx_lm.models.gated_delta.gated_delta_update`` computed in chunks
    (same arguments); masked or per-channel gating goes to mlx-lm's own."""
    from mlx_lm.models import gated_delta

    if mask is not None or a.ndim != 3:
        return gated_delta.gated_delta_update(
            q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
            lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    decay_rate = mx.exp(A_log.astype(mx.float32))
    if lower_bound is None:  # log of gated_delta.compute_g, without its exp
        log_g = -decay_rate * nn.softplus(a + dt_bias)
    else:
        log_g = lower_bound * mx.sigmoid(decay_rate * (a.astype(mx.float32) + dt_bias))
    B, _, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)
    return chunked(q, k, v, log_g, beta, state)


@contextmanager
def in_chunks():
    """mlx-lm's qwen3_next layers compute the rule in chunks while inside."""
    from mlx_lm.models import qwen3_next

    original = qwen3_next.gated_delta_update
    qwen3_next.gated_delta_update = update
    try:
        yield
    finally:
        qwen3_next.gated_delta_update = original
