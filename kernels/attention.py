"""One attention-backend selector for every transformer we serve, applied through diffusers' attention dispatch.

`--attention NAME` picks the kernel. diffusers' `dispatch_attention_fn` runs it: every processor that carries an
`_attention_backend` attribute (FLUX's own, ours below) passes it there, as `ModelMixin.set_attention_backend` would
set it. We set the attribute ourselves instead of calling `set_attention_backend`, which also changes a process-wide
default and logs an "experimental" warning on every load. SD3's stock `JointAttnProcessor2_0` calls SDPA directly
(diffusers 0.42), so for any backend but `sdpa` it is swapped for `DispatchJointAttnProcessor`, the same steps with
the attention call dispatched. The Ulysses processors (models/, through kernels/ulysses.py) call `attention` too.

`auto` (the default) is flash-attn on a CUDA device in fp16 or bf16 where the package imports and passes diffusers'
own version check, SDPA otherwise. A backend that cannot run here (no GPU, package missing or too old, a float32
model for a kernel that takes only fp16/bf16) is a start-up error naming what is missing; flash-attn is imported
only when chosen (or probed by `auto` on a GPU).

flash-attn (2 and 3) and SageAttention refuse attention masks, which the families that pad texts in a batch pass
(Qwen-Image, Z-Image: `Family.attention_masks`). Their transformers get the varlen form of the same kernel instead,
which takes a key-padding mask (`MASKED`): a masked call never reaches a kernel that rejects it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

# Our names -> diffusers' AttentionBackendName values.
BACKENDS: dict[str, str] = {
    "sdpa": "native",  # torch's scaled_dot_product_attention, which picks its own kernel
    "math": "_native_math",  # SDPA's reference kernel (any device; slow; for checking)
    "efficient": "_native_efficient",  # SDPA's memory-efficient kernel (CUDA)
    "cudnn": "_native_cudnn",  # SDPA's cuDNN kernel (CUDA)
    "flash": "flash",  # flash-attn 2 (CUDA, fp16/bf16)
    "flash3": "_flash_3",  # flash-attn 3 (Hopper)
    "sage": "sage",  # SageAttention (CUDA)
    "xformers": "xformers",  # xFormers memory-efficient attention (CUDA)
    "flex": "flex",  # torch flex_attention (compiled)
}
CHOICES: tuple[str, ...] = ("auto", *BACKENDS)
# What each backend needs beyond torch: (module to import, pip package).
_PACKAGES: dict[str, tuple[str, str]] = {
    "flash": ("flash_attn", "flash-attn"),
    "flash3": ("flash_attn_interface", "flash-attn 3 (built from source)"),
    "sage": ("sageattention", "sageattention"),
    "xformers": ("xformers", "xformers"),
}
_CUDA_ONLY = {"efficient", "cudnn", "flash", "flash3", "sage", "xformers"}
# Kernels for fp16 and bf16 tensors only (models/loading/setup.py HALF_ONLY_ATTENTION says the same without torch).
HALF_ONLY = ("flash", "flash3", "sage")
# For transformers whose attention takes masks: the kernel (diffusers' name) that does what each of ours does and
# takes a key-padding mask.
MASKED: dict[str, str] = {"flash": "flash_varlen", "flash3": "_flash_varlen_3", "sage": "sage_varlen"}


class AttentionUnavailable(ValueError):
    """The chosen backend cannot run here; the message says why and what to do."""


def resolve(choice: str, device: str | torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The backend `choice` means on `device` for a model in `dtype` ("auto": the best available), or
    AttentionUnavailable."""
    device = torch.device(device)
    if choice == "auto":
        if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
            try:
                return resolve("flash", device, dtype)
            except AttentionUnavailable:
                pass
        return "sdpa"
    if choice not in BACKENDS:
        raise AttentionUnavailable(f"--attention {choice!r}: not a backend; choose from {', '.join(CHOICES)}")
    if choice in _CUDA_ONLY and device.type != "cuda":
        raise AttentionUnavailable(f"--attention {choice} needs a CUDA device; the model is on {device.type}")
    if choice in HALF_ONLY and dtype not in (torch.float16, torch.bfloat16):
        dtype_name = str(dtype).removeprefix("torch.")
        raise AttentionUnavailable(
            f"--attention {choice} runs in float16 or bfloat16 only; the model is {dtype_name} (--dtype bfloat16)"
        )
    if choice in _PACKAGES:
        module, package = _PACKAGES[choice]
        if importlib.util.find_spec(module) is None:
            raise AttentionUnavailable(f"--attention {choice} needs the {package} package, which is not installed")
    # diffusers' own checks (package versions, kernels hub), for the kernel and its masked form.
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    for name in (BACKENDS[choice], MASKED.get(choice)):
        try:
            if name is not None:
                _check_attention_backend_requirements(AttentionBackendName(name))
        except RuntimeError as exc:
            raise AttentionUnavailable(f"--attention {choice}: {exc}") from exc
    return choice


def _diffusers_backend(name: str | None, masked: bool = False) -> Any:
    if name is None or name == "sdpa":
        return None
    from diffusers.models.attention_dispatch import AttentionBackendName

    return AttentionBackendName(MASKED[name] if masked and name in MASKED else BACKENDS[name])


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: Any = None, attn_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention over [B, H, S, d] tensors (SDPA's layout), with `backend` (a diffusers AttentionBackendName, as
    processors carry it; None: SDPA) and an optional mask broadcastable to [B, H, S_q, S_k] (True: attend)."""
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    # dispatch_attention_fn takes and returns [B, S, H, d].
    out = dispatch_attention_fn(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, backend=backend
    )
    return out.transpose(1, 2)


class DispatchJointAttnProcessor:
    """diffusers' `JointAttnProcessor2_0` (SD3's joint attention; its blocks pass [B, S, D] only) with its attention
    call dispatched to `_attention_backend`. Subclasses replace `_attend` (models/families/sd3.py shards it)."""

    _attention_backend = None
    _parallel_config = None

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, text_len: int) -> torch.Tensor:
        """[B, H, S + T, d] -> [B, H, S + T, d]; the last `text_len` tokens are the context's."""
        return attention(query, key, value, self._attention_backend)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        residual = hidden_states
        batch_size = hidden_states.shape[0]
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (x.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2) for x in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        text_len = 0
        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            eq, ek, ev = (
                proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
                for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            )
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query, key, value = (torch.cat([a, b], dim=2) for a, b in ((query, eq), (key, ek), (value, ev)))
        hidden_states = self._attend(query, key, value, text_len)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : residual.shape[1]],
                hidden_states[:, residual.shape[1] :],
            )
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


def apply(transformer: torch.nn.Module, backend: str, masked: bool = False) -> int:
    """Route every attention layer of `transformer` to `backend` (resolved); the number of layers set. `sdpa`
    leaves processors that call SDPA themselves as they are. `masked`: the transformer's attention takes masks, so a
    kernel that refuses them is replaced by its varlen form (MASKED)."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    target = _diffusers_backend(backend, masked)
    count = 0
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is None or not callable(getattr(module, "set_processor", None)):
            continue
        if target is not None and type(processor) is JointAttnProcessor2_0:
            processor = DispatchJointAttnProcessor()
            module.set_processor(processor)
        if hasattr(processor, "_attention_backend"):
            processor._attention_backend = target
            count += 1
    return count
