"""`prepare(model, policy)`: the one place that rewrites a loaded model's weights for execution.

The values never change, only how they are stored: a 16-bit weight as its contiguous W.T (bf16,
the same bytes, where the CPU kernels widen it; float32 where MLX would convert it at every
call), linear layers as the classes that split across CPU streams or call the CPU kernels, the
codec's product weights as float32 W.T that numpy's BLAS reads in place. The bytes the model
keeps afterwards are recorded on the returned `Prepared`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from voicechat.model import ops
from voicechat.model.audio.codec import ConvNeXtBlock
from voicechat.model.audio.conformer import ConvModule
from voicechat.runtime import heap
from voicechat.runtime.execution import Runtime
from voicechat.runtime.linear import prepare_linears, replace_weight_transposed, resident_bytes, transposed_dtype
from voicechat.runtime.policy import ExecutionPolicy


@dataclass
class Prepared:
    """What `prepare` did: the runtime to bind, the layers it changed, the bytes the model keeps."""

    runtime: Runtime
    linears: dict = field(default_factory=dict)  # {"split": [...], "float32": [...], "bf16_transposed": [...]}
    resident_bytes: int = 0
    heap_kept: bool = False


def _one_by_one():
    return (lambda w: w[:, 0, :], lambda w_t: w_t.T[:, None, :])


def transpose_pointwise_convs(conv_module, policy: ExecutionPolicy) -> None:
    """A conformer ConvModule's two 1x1 conv weights as their W.T (float32, or bf16 where the
    policy's product widens it) as the only resident copy (the parameter `weight` becomes an
    (O, 1, I) view of it), biases as float32. Exact: the values and every product are the same."""
    for conv in (conv_module.pointwise_conv1, conv_module.pointwise_conv2):
        if ops.stored_transposed(conv) is None:
            to_matrix, from_matrix_t = _one_by_one()
            replace_weight_transposed(conv, to_matrix, from_matrix_t, dtype=transposed_dtype(conv.weight.dtype, policy))
            if "bias" in conv and conv.bias.dtype != mx.float32:
                conv.bias = conv.bias.astype(mx.float32)


def float32_codec_weights(decoder, policy: ExecutionPolicy) -> None:
    """The codec decoder's product weights as float32 W.T, the only resident copy: with the
    products on the host every 1x1 conv and upsampler (numpy's float32 W.T is then a view of the
    same buffer); otherwise the ConvNeXt 1x1 convs unless the policy keeps weights as stored
    (`float32_copies` False: MLX converts them per product). Evaluated layer by layer: at most one
    layer's originals beside their copies."""

    last = len(decoder.layers) - 1
    for n, layer in enumerate(decoder.layers):
        if isinstance(layer, ConvNeXtBlock):
            copies = policy.host_products or policy.float32_copies is not False
            targets = [(layer.pwconv1, _one_by_one()), (layer.pwconv2, _one_by_one())] if copies else []
        elif not policy.host_products:
            targets = []
        elif n == last:
            targets = [(layer, _one_by_one())]
        else:  # upsampler (O, K, I) as its (K O, I) matrix (`codec._upsample`)
            out_ch, kernel, in_ch = layer.weight.shape
            targets = [
                (
                    layer,
                    (
                        lambda w, k=kernel, o=out_ch, i=in_ch: w.transpose(1, 0, 2).reshape(k * o, i),
                        lambda w_t, k=kernel, o=out_ch, i=in_ch: w_t.T.reshape(k, o, i).transpose(1, 0, 2),
                    ),
                )
            ]
        made = [
            replace_weight_transposed(conv, to_matrix, from_matrix_t)
            for conv, (to_matrix, from_matrix_t) in targets
            if ops.stored_transposed(conv) is None
        ]
        mx.eval(made)


def before_reading(policy: ExecutionPolicy) -> bool:
    """What the policy sets up before a checkpoint's weights are read: glibc's heap thresholds
    (`keep_heap`), so the weights and every later temporary are placed under them from the
    start (set after the read, the weights' allocations would sit where glibc's defaults put
    them). Returns whether the heap is kept."""
    if policy.keep_heap and mx.default_device().type == mx.DeviceType.cpu:
        return heap.keep_heap()
    return False


def prepare(model: nn.Module, policy: ExecutionPolicy) -> Prepared:
    """Rewrite `model`'s weight layout for `policy` (bit for bit the same values) and make the
    per-weights constants its frames use, under the runtime it returns (`Prepared.runtime`)."""

    runtime = Runtime(policy)
    done = Prepared(runtime)
    done.heap_kept = before_reading(policy)  # glibc keeps freed large temporaries (once per process)
    with runtime.frame():
        done.linears = prepare_linears(model, policy)
        model.tts_model.tts_model.rvq_books()  # float32 codebooks and their norms, once
        for module in model.modules():  # at the published shapes making these took 1.8 s of the first frame
            if isinstance(module, ConvModule):
                transpose_pointwise_convs(module, policy)
                module.pointwise_weights()  # evaluates W.T (releasing the originals)
        codec = model.tts_model.audio_codec
        float32_codec_weights(codec.decoder, policy)
        codec.prepare_decoder()  # its derived float32 / numpy weights, taken (and counted) here
    done.resident_bytes = resident_bytes(model)
    return done


__all__ = ["Prepared", "before_reading", "float32_codec_weights", "prepare", "transpose_pointwise_convs"]
