"""Layer-by-layer architecture arithmetic of the paper's six benchmark models (table 1).

Pure, no torch. Each builder returns the model's chain of :class:`LayerSpec`: exact fp32
parameter counts, forward FLOPs, output elements and kept-for-backward bytes per sample.
:mod:`dapple.profiler.paper_models` turns FLOPs into V100 times.

Counting conventions (per sample, fp32, 4 bytes per element):
    - FLOPs = 2 x multiply-accumulates of the matrix products/convolutions; element-wise work
      is charged as memory traffic by the time model instead.
    - Kept bytes follow what PyTorch autograd saves: a convolution or linear layer keeps its
      input, batch norm keeps its input, ReLU keeps its output, max-pooling keeps int64
      indices, dropout keeps a one-byte mask, softmax keeps its output.
    - A layer's output is what crosses a cut placed after it; it is a tuple when several
      tensors flow on (e.g. GNMT's target embeddings ride through the encoder layers,
      AmoebaNet cells consume the two previous cells' outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "LayerSpec",
    "amoebanet36_layers",
    "bert48_layers",
    "gnmt16_layers",
    "resnet50_layers",
    "vgg19_layers",
    "xlnet36_layers",
]

_F32 = 4  # bytes per fp32 element
_I64 = 8  # bytes per int64 element (max-pool indices, token ids)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer of a paper model, as pure architecture arithmetic."""

    name: str
    parameter_count: int
    """Number of fp32 parameters (trainable; batch-norm running statistics are buffers)."""
    forward_flops_per_sample: float
    """2 x multiply-accumulates of one sample's forward pass."""
    output_elements_per_sample: int
    """Elements of the layer's output (all tensors crossing a cut after it)."""
    kept_bytes_per_sample: float
    """Bytes autograd keeps from forward until backward for one sample."""


class _Acc:
    """Accumulates the parameters, FLOPs and kept bytes of the operators of one layer."""

    def __init__(self) -> None:
        self.params = 0
        self.flops = 0.0
        self.kept = 0.0

    def conv(
        self,
        cin: int,
        cout: int,
        kh: int,
        kw: int,
        h_out: int,
        w_out: int,
        h_in: int,
        w_in: int,
        *,
        bias: bool = False,
        bn: bool = True,
        relu: bool = True,
    ) -> None:
        """Conv (keeps its input) + optional BN (keeps its input) + ReLU (keeps output)."""
        self.params += kh * kw * cin * cout + (cout if bias else 0) + (2 * cout if bn else 0)
        self.flops += 2.0 * kh * kw * cin * cout * h_out * w_out
        out = cout * h_out * w_out
        self.kept += _F32 * (cin * h_in * w_in + (out if bn else 0) + (out if relu else 0))

    def linear(self, n_in: int, n_out: int, rows: int = 1, *, bias: bool = True) -> None:
        """``rows`` rows (tokens) through an ``n_in -> n_out`` linear layer (keeps its input)."""
        self.params += n_in * n_out + (n_out if bias else 0)
        self.flops += 2.0 * rows * n_in * n_out
        self.kept += _F32 * rows * n_in

    def maxpool(self, elements_out: int) -> None:
        self.kept += _I64 * elements_out

    def keep(self, elements: float, bytes_per_element: int = _F32) -> None:
        self.kept += bytes_per_element * elements

    def done(self, name: str, output_elements: int) -> LayerSpec:
        return LayerSpec(name, self.params, self.flops, output_elements, self.kept)


# ----------------------------------------------------------------------------- CNNs


def resnet50_layers(image: int = 224, classes: int = 1000) -> list[LayerSpec]:
    """ResNet-50 v1.5 (stride on the 3x3 conv): stem, 16 bottleneck blocks, head = 18 layers."""
    layers: list[LayerSpec] = []
    a = _Acc()
    h = image // 2
    a.conv(3, 64, 7, 7, h, h, image, image)
    h //= 2
    a.maxpool(64 * h * h)
    layers.append(a.done("stem", 64 * h * h))
    cin = 64
    for stage, (blocks, mid) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512))):
        for blk in range(blocks):
            stride = 2 if (blk == 0 and stage > 0) else 1
            a = _Acc()
            h2 = h // stride
            a.conv(cin, mid, 1, 1, h, h, h, h)
            a.conv(mid, mid, 3, 3, h2, h2, h, h)
            a.conv(mid, 4 * mid, 1, 1, h2, h2, h2, h2, relu=False)
            if stride != 1 or cin != 4 * mid:
                a.conv(cin, 4 * mid, 1, 1, h2, h2, h, h, relu=False)
            a.keep(4 * mid * h2 * h2)  # ReLU after the residual add
            h, cin = h2, 4 * mid
            layers.append(a.done(f"layer{stage + 1}.{blk}", cin * h * h))
    a = _Acc()
    a.linear(cin, classes)  # global average pool (keeps nothing) + fc
    a.keep(classes)  # softmax of the cross-entropy loss
    layers.append(a.done("fc+loss", classes))
    return layers


def vgg19_layers(image: int = 224, classes: int = 1000) -> list[LayerSpec]:
    """VGG-19: 16 conv layers (a max-pool folded into the conv before it) + 3 fc = 19 layers."""
    cfg = [64, 64, 0, 128, 128, 0, 256, 256, 256, 256, 0, 512, 512, 512, 512, 0]
    cfg += [512, 512, 512, 512, 0]
    layers: list[LayerSpec] = []
    cin, h = 3, image
    convs = [(c, i + 1 < len(cfg) and cfg[i + 1] == 0) for i, c in enumerate(cfg) if c]
    for k, (cout, pooled) in enumerate(convs):
        a = _Acc()
        a.conv(cin, cout, 3, 3, h, h, h, h, bias=True, bn=False)
        if pooled:
            h //= 2
            a.maxpool(cout * h * h)
        cin = cout
        layers.append(a.done(f"conv{k + 1}", cout * h * h))
    n_in = cin * h * h
    for k, n_out in enumerate((4096, 4096)):
        a = _Acc()
        a.linear(n_in, n_out)
        a.keep(n_out)  # ReLU output
        a.keep(n_out, 1)  # dropout mask
        layers.append(a.done(f"fc{k + 1}", n_out))
        n_in = n_out
    a = _Acc()
    a.linear(n_in, classes)
    a.keep(classes)
    layers.append(a.done("fc3+loss", classes))
    return layers


def amoebanet36_layers(
    image: int = 224, filters: int = 512, cells_per_stack: int = 12, classes: int = 1000
) -> list[LayerSpec]:
    """AmoebaNet-D(36, 512): stem, 2 stem reduction cells, 3 stacks of 12 normal cells with a
    reduction cell between stacks, head = 42 layers.

    Normal cell (after the AmoebaNet-D genotype used by GPipe): both inputs pre-processed by
    ReLU-1x1 conv-BN to ``C`` channels; ten operators over the hidden states: three 1x1 convs,
    two "1x7 then 7x1" convs (bottleneck ``C -> C/4 -> C``), max/avg pools and identities; the
    output concatenates four states (``4C`` channels), about ``13.75 C^2`` parameters. Reduction
    cells halve the spatial size and double ``C`` (stride-2 max pools, a stride-2 1x1 conv and
    one 1x7-7x1 conv). A cell's output is the pair (previous cell output, its own output),
    since the next cell consumes both. Approximation of the real genotype (documented in
    ``paper_models``): the parameter total lands within 2% of table 1's 933M.
    """
    layers: list[LayerSpec] = []
    h = image // 2
    a = _Acc()
    c_stem = filters // 4
    a.conv(3, c_stem, 3, 3, h, h, image, image, relu=False)
    layers.append(a.done("stem", c_stem * h * h))
    prev_ch, prev_prev_ch, prev_h, prev_prev_h = c_stem, c_stem, h, h

    def cell(name: str, c: int, reduce: bool) -> None:
        nonlocal prev_ch, prev_prev_ch, prev_h, prev_prev_h
        a = _Acc()
        h_in = prev_h
        h_out = h_in // 2 if reduce else h_in
        # pre-processing 1x1 convs of both inputs (prev-prev may be at twice the resolution:
        # then the 1x1 conv has stride 2)
        a.conv(prev_prev_ch, c, 1, 1, h_in, h_in, prev_prev_h, prev_prev_h, relu=False)
        a.conv(prev_ch, c, 1, 1, h_in, h_in, h_in, h_in, relu=False)
        hw_in, hw_out = h_in * h_in, h_out * h_out
        q = max(1, c // 4)
        a.conv(c, c, 1, 1, h_out, h_out, h_in, h_in)  # conv_1x1 (stride 2 in reduction)
        for _ in range(1 if reduce else 2):
            a.conv(c, q, 1, 1, h_in, h_in, h_in, h_in)  # 1x7-7x1 bottleneck C -> C/4 -> C
            a.conv(q, q, 1, 7, h_in, h_in, h_in, h_in)
            a.conv(q, q, 7, 1, h_out, h_out, h_in, h_in)
            a.conv(q, c, 1, 1, h_out, h_out, h_out, h_out)
        if reduce:
            a.maxpool(2 * c * hw_out)  # two stride-2 max pools
        else:
            a.conv(c, c, 1, 1, h_in, h_in, h_in, h_in)  # two more conv_1x1
            a.conv(c, c, 1, 1, h_in, h_in, h_in, h_in)
            a.maxpool(2 * c * hw_in)
            a.keep(3 * c * hw_in)  # sums of operator pairs feeding later operators
        n_concat = 4
        out_ch = n_concat * c
        prev_prev_elems = prev_ch * hw_in
        layers.append(a.done(name, prev_prev_elems + out_ch * hw_out))
        prev_prev_ch, prev_ch, prev_prev_h, prev_h = prev_ch, out_ch, prev_h, h_out

    cell("stem_cell0", filters // 4, True)
    cell("stem_cell1", filters // 2, True)
    for stack in range(3):
        c = filters * 2**stack
        if stack > 0:
            cell(f"reduction{stack}", c, True)
        for i in range(cells_per_stack):
            cell(f"stack{stack}.cell{i}", c, False)
    a = _Acc()
    a.linear(prev_ch, classes)  # ReLU + global average pool + fc
    a.keep(prev_ch * prev_h * prev_h)
    a.keep(classes)
    layers.append(a.done("head+loss", classes))
    return layers


# ----------------------------------------------------------------------------- sequence models


def _attention_kept(a: _Acc, s: int, h: int, heads: int) -> None:
    """Element-wise state of a post-LN transformer block (fp32 + one-byte dropout masks)."""
    a.keep(3 * s * h)  # Q, K, V kept by the score / context products
    a.keep(2 * heads * s * s)  # softmax output + dropped-out probabilities
    a.keep(heads * s * s + 2 * s * h, 1)  # attention-probability and two residual dropout masks
    a.keep(2 * s * h)  # the two LayerNorm inputs
    a.keep(4 * s * h)  # GELU input (the FFN's first output)


def bert48_layers(
    seq: int = 512, hidden: int = 1024, heads: int = 16, layers_n: int = 48, vocab: int = 30522
) -> list[LayerSpec]:
    """BERT-48 (BERT-large widths, 48 blocks) for SQuAD: embeddings, 48 blocks, span head."""
    s, h = seq, hidden
    out: list[LayerSpec] = []
    a = _Acc()
    a.params += (vocab + seq + 2) * h + 2 * h  # word, position, token-type embeddings + LN
    a.keep(2 * s, _I64)  # token and segment ids
    a.keep(s * h)  # LayerNorm input
    a.keep(s * h, 1)  # dropout mask
    out.append(a.done("embeddings", s * h))
    for i in range(layers_n):
        a = _Acc()
        a.linear(h, 3 * h, s)  # QKV
        a.flops += 2.0 * 2 * s * s * h  # scores and context
        a.linear(h, h, s)  # attention output projection
        a.params += 2 * h  # LayerNorm
        a.linear(h, 4 * h, s)
        a.linear(4 * h, h, s)
        a.params += 2 * h
        _attention_kept(a, s, h, heads)
        out.append(a.done(f"block{i}", s * h))
    a = _Acc()
    a.linear(h, 2, s)  # start / end logits
    a.keep(2 * s)  # softmax outputs
    out.append(a.done("qa_head+loss", 2 * s))
    return out


def xlnet36_layers(
    seq: int = 512, hidden: int = 1024, heads: int = 16, layers_n: int = 36, vocab: int = 32000
) -> list[LayerSpec]:
    """XLNet-36 (XLNet-large widths, 36 blocks), single-stream fine-tuning on SQuAD, no memory.

    Relative-attention blocks: bias-free q, k, v, o and positional projections (5 h^2), three
    attention biases and a segment embedding, post-LN FFN (h -> 4h -> h).
    """
    s, h = seq, hidden
    out: list[LayerSpec] = []
    a = _Acc()
    a.params += vocab * h + h  # word embedding + mask embedding
    a.keep(2 * s, _I64)
    a.keep(s * h, 1)
    # the relative positional encoding (2s x h) is recomputed from sin/cos in every block
    out.append(a.done("embeddings", s * h))
    for i in range(layers_n):
        a = _Acc()
        a.linear(h, 3 * h, s, bias=False)  # q, k, v
        a.linear(h, h, 2 * s, bias=False)  # positional keys over the 2s relative positions
        a.flops += 2.0 * (2 * s * s * h + 2 * s * 2 * s * h)  # content, context, position scores
        a.linear(h, h, s, bias=False)  # o
        a.params += 3 * h + 2 * h + 2 * h  # r_w/r_r/r_s biases, segment embedding, LayerNorm
        a.linear(h, 4 * h, s)
        a.linear(4 * h, h, s)
        a.params += 2 * h
        _attention_kept(a, s, h, heads)
        a.keep(2 * heads * s * s)  # positional scores before and after the relative shift
        out.append(a.done(f"block{i}", s * h))
    a = _Acc()
    a.linear(h, 2, s)
    a.keep(2 * s)
    out.append(a.done("qa_head+loss", 2 * s))
    return out


def _lstm(a: _Acc, n_in: int, h: int, s: int) -> None:
    """One unidirectional LSTM layer over ``s`` steps (PyTorch layout: two bias vectors)."""
    a.params += 4 * h * (n_in + h) + 8 * h
    a.flops += 2.0 * s * 4 * h * (n_in + h)
    a.keep(s * (n_in + h))  # inputs and previous hidden states of the gate products
    a.keep(s * 6 * h)  # four gate activations, cell state and tanh(cell state)


def gnmt16_layers(
    seq: int = 50, hidden: int = 1024, vocab: int = 32320, enc: int = 8, dec: int = 8
) -> list[LayerSpec]:
    """GNMT-16 (MLPerf/PipeDream layout): embeddings, 8 encoder and 8 decoder LSTM layers,
    classifier = 18 layers.

    Encoder layer 0 is bidirectional, layer 1 reads its 2h output, layers 2+ are residual.
    Decoder layer 0 runs normalized Bahdanau attention over the encoder output; the attention
    context is concatenated to the input of decoder layers 1+ (LSTM 2h -> h). The target
    embeddings ride along through the encoder layers, so a cut there carries them too.
    Source and target lengths are both ``seq`` tokens.
    """
    s, h = seq, hidden
    out: list[LayerSpec] = []
    a = _Acc()
    a.params += 2 * vocab * h  # separate source and target embeddings
    a.keep(2 * s, _I64)
    a.keep(2 * s * h, 1)  # dropout masks
    out.append(a.done("embeddings", 2 * s * h))
    for i in range(enc):
        a = _Acc()
        if i == 0:
            _lstm(a, h, h, s)
            _lstm(a, h, h, s)
            width = 2 * h
        else:
            _lstm(a, 2 * h if i == 1 else h, h, s)
            width = h
        out.append(a.done(f"encoder{i}", s * width + s * h))
    for i in range(dec):
        a = _Acc()
        if i == 0:
            _lstm(a, h, h, s)
            a.linear(h, h, s, bias=False)  # query projection
            a.linear(h, h, s, bias=False)  # key projection of the encoder output
            a.params += 2 * h + 1  # attention vector, normalize bias and scalar
            a.flops += 2.0 * 2 * s * s * h  # additive scores and context
            a.keep(3 * s * s)  # scores, softmax output, mask
            a.keep(s * s * h / 8)  # tanh(q + k) slices (computed in chunks)
            width = 2 * s * h
        else:
            _lstm(a, 2 * h, h, s)
            width = 2 * s * h
        out.append(a.done(f"decoder{i}", width))
    a = _Acc()
    a.linear(h, vocab, s)
    a.keep(s * vocab)  # log-softmax output
    out.append(a.done("classifier+loss", s * vocab))
    return out
