"""``impl.precision: fp8``: the encoder layers' matmuls in float8, everything else as in bf16.

The weights, the optimiser and DeepSpeed stay as in a bf16 run (a bf16 checkpoint, resumable in
either precision). Each linear layer of the encoder casts its input and its weight to float8 e4m3,
and in the backward the gradient of its output to e5m2 (more range, fewer digits, as gradients
need), each with one scale for the whole tensor taken from its largest magnitude at every call
(dynamic tensorwise scaling: no history to carry in a checkpoint, no host read), and multiplies them
with ``torch._scaled_mm`` into bf16, accumulating in fp32 (Micikevicius et al., "FP8 Formats for
Deep Learning", 2022). torch.compile fuses each cast with its scale's reduction. The MLM head, the
decoder and the embeddings stay in bf16: the head runs only at masked positions, where float8 saves
little and the logits want the range.

Why not Transformer Engine's fused modules: its CUDA wheel is 729 MB against the 64 MiB a GPU
lease carries, and its torch extension is built for one torch release. torchao's float8 training
does what this module does and more (float8 all-gathers for FSDP), but importing it is what
transformers does whenever it is installed (every run paid its import and its warnings); these 100
lines need only torch.

On a CPU, where ``torch._scaled_mm`` takes ~175 ms a call at any size (torch 2.13), the same
float8 values are multiplied in fp32 instead (exact products, fp32 sums: what the GPU computes, up
to the order of the sums), so that tests train in fp8 in seconds. Needs float8 tensor cores on
CUDA (compute capability 8.9+: Ada, Hopper, Blackwell); refused by name on an older GPU."""

from __future__ import annotations

import torch

MIN_CAPABILITY = (8, 9)  # the first CUDA GPUs with float8 tensor cores (Ada; Hopper is 9.0)
FORWARD, BACKWARD = torch.float8_e4m3fn, torch.float8_e5m2


def problems(cuda_capability: tuple[int, int] | None) -> list[str]:
    """Why fp8 cannot run here, before any process group starts (``cuda_capability``: the GPU's, or
    None without CUDA, where it is emulated)."""
    if cuda_capability is None or tuple(cuda_capability) >= MIN_CAPABILITY:
        return []
    major, minor = cuda_capability
    return [
        f"impl.precision: fp8 needs float8 tensor cores (CUDA compute capability 8.9+: Ada, Hopper, "
        f"Blackwell); this GPU is {major}.{minor}: use bf16"
    ]


def to_float8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(``t`` in ``dtype`` scaled so that its largest magnitude is the format's largest, the
    inverse scale as an fp32 scalar on the device)."""
    largest = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float().clamp(min=1e-12)  # an all-zero tensor stays zero
    scale = largest / amax
    return (t.float() * scale).clamp(-largest, largest).to(dtype), scale.reciprocal()


def scaled_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype) -> torch.Tensor:
    """``a @ b`` of two float8 tensors with their inverse scales: ``a`` row-major [M, K], ``b``
    column-major [K, N], as ``torch._scaled_mm`` takes them."""
    if a.device.type == "cuda" and a.shape[0] % 16 == 0 and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0:
        return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
    # Elsewhere (a CPU; CUDA shapes cuBLAS's float8 kernels do not take): the float8 values exactly.
    return (torch.mm(a.float(), b.float()) * (a_inv * b_inv)).to(out_dtype)


def column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


class Float8Matmul(torch.autograd.Function):
    """``x @ weight.T`` with float8 operands both ways; saves the float8 copies (half of bf16's
    memory), not the inputs, so ZeRO 3 may release the weight after the forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x8, x_inv = to_float8(x, FORWARD)
        w8, w_inv = to_float8(weight, FORWARD)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.dtypes = x.dtype, weight.dtype
        return scaled_mm(x8, x_inv, w8.t(), w_inv, x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        g8, g_inv = to_float8(grad, BACKWARD)
        grad_x = scaled_mm(g8, g_inv, column_major(w8), w_inv, ctx.dtypes[0])  # [M, N] @ [N, K]
        grad_w = scaled_mm(g8.t().contiguous(), g_inv, column_major(x8), x_inv, ctx.dtypes[1])  # [N, M] @ [M, K]
        return grad_x, grad_w


class Float8Linear(torch.nn.Linear):
    """A ``torch.nn.Linear`` whose matmul runs in float8; the same parameters, names and state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = Float8Matmul.apply(x.reshape(-1, self.in_features), self.weight)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def in_encoder(name: str, module: torch.nn.Module) -> bool:
    """A linear layer of an encoder layer (BERT's ``encoder.layer.N``, ModernBERT's ``layers.N``)
    whose sizes float8 kernels take (multiples of 16)."""
    if type(module) is not torch.nn.Linear or not (".encoder.layer." in f".{name}" or ".layers." in f".{name}"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(model: torch.nn.Module) -> int:
    """The encoder's linear layers of ``model`` made ``Float8Linear`` in place (their class changed:
    parameters, hooks and state dict untouched); returns how many."""
    layers = [m for name, m in model.named_modules() if in_encoder(name, m)]
    for module in layers:
        module.__class__ = Float8Linear
    return len(layers)
