"""CUDA correctness (``pytest -m gpu``; skipped without a CUDA device). Run by ``benchmarks/gpu/run.sh``.

* every registered mixer, forward and backward on CUDA in float32 and bfloat16, against the same mixer (same weights)
  on the CPU in float64;
* every kernel backend that can run on CUDA against the ``reference`` backend at real sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch

import mixer_plugins as mp
from mixer_plugins import kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# relative error bounds (max |a - b| / max |b|)
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 5e-2}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def _build(name: str, dim: int, length: int):
    spec = mp.get_spec(name)
    options = {}
    fields = spec.config.model_fields
    if "max_seq_len" in fields:
        options["max_seq_len"] = length
    if "num_heads" in fields:
        options["num_heads"] = 4
    torch.manual_seed(0)
    return mp.create_mixer(name, dim, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", mp.list_mixers())
def test_mixer_on_cuda_matches_cpu_float64(name, dtype):
    dim, length = 64, 96
    reference = _build(name, dim, length).double()
    mixer = copy.deepcopy(reference).to("cuda", dtype)
    x = torch.randn(2, length, dim, dtype=torch.float64)
    x_ref = x.clone().requires_grad_(True)
    x_gpu = x.to("cuda", dtype).requires_grad_(True)
    y_ref = reference(x_ref)
    y_gpu = mixer(x_gpu)
    assert _relative_error(y_gpu.float().cpu(), y_ref) < TOLERANCE[dtype]
    grad = torch.randn_like(y_ref)
    y_ref.backward(grad)
    y_gpu.backward(grad.to("cuda", dtype))
    assert _relative_error(x_gpu.grad.float().cpu(), x_ref.grad) < TOLERANCE[dtype]
    for (pname, p_ref), (_, p_gpu) in zip(reference.named_parameters(), mixer.named_parameters()):
        if p_ref.grad is not None:
            assert _relative_error(p_gpu.grad.float().cpu(), p_ref.grad) < TOLERANCE[dtype] * 4, pname


def _scan_inputs(batch=2, length=1024, heads=8, p=64, groups=2, n=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to("cuda", dtype).requires_grad_(True)

    return dict(x=r(batch, length, heads, p), dt=r(batch, length, heads, scale=0.5),
                A=(-torch.rand(heads, generator=g) - 0.5).cuda().requires_grad_(True),
                B=r(batch, length, groups, n, scale=0.3), C=r(batch, length, groups, n, scale=0.3))


# (output, gradients) bounds on float32 inputs. Ours: float32 accumulation, matmuls in 3xTF32 (about float32).
# mamba-ssm's Triton kernels take float32 matmuls in plain TF32 (10 mantissa bits); on the H200 its outputs
# differ from the reference backend by 1.4e-3 to 1.9e-3 (relative to the largest), hence its own bound.
SCAN_TOLERANCE = {"default": (1e-3, 5e-3), "mamba_ssm": (5e-3, 1e-2)}


def _gpu_backends(op: str) -> list[str]:
    return [b for b in kernels.available_backends(op, "cuda") if b != "reference"]


@pytest.mark.parametrize("op", ["quasiseparable", "ssd"])
def test_kernel_backends_on_cuda_match_reference(op):
    backends = _gpu_backends("scan")
    if not backends:
        pytest.skip(f"no CUDA backend of {op} can run here")
    inputs = _scan_inputs()
    fn = getattr(kernels, op)
    extra = {"shift": True} if op == "quasiseparable" else {}
    ref = fn(**inputs, chunk_size=64, dt_softplus=True, backend="reference", **extra)
    ref_grads = torch.autograd.grad(ref.sum(), list(inputs.values()))
    for backend in backends:
        out = fn(**inputs, chunk_size=64, dt_softplus=True, backend=backend, **extra)
        bound = SCAN_TOLERANCE.get(backend, SCAN_TOLERANCE["default"])
        assert _relative_error(out, ref) < bound[0], backend
        grads = torch.autograd.grad(out.sum(), list(inputs.values()))
        for name, g, g_ref in zip(inputs, grads, ref_grads):
            assert _relative_error(g, g_ref) < bound[1], (backend, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_mlr_attention_backends_on_cuda_match_reference(causal, dtype):
    """Every CUDA backend of mlr_attention (the Triton kernel among them) against the reference, at 1000 tokens
    (not a multiple of the tile) with right padding, values and gradients."""
    backends = _gpu_backends("mlr_attention")
    if not backends:
        pytest.skip("no CUDA backend of mlr_attention can run here")
    g = torch.Generator().manual_seed(0)
    b, length, h, ranks, block_sizes, p = 2, 1000, 4, [32, 16, 8, 8], [None, 256, 64, 16], 64

    def r(*shape):
        return torch.randn(*shape, generator=g).to("cuda", dtype).requires_grad_(True)

    q, k, v = r(b, length, h, sum(ranks)), r(b, length, h, sum(ranks)), r(b, length, h, p)
    mask = torch.ones(b, length, dtype=torch.bool, device="cuda")
    mask[1, 900:] = False
    kw = dict(ranks=ranks, block_sizes=block_sizes, causal=causal, mask=mask)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = kernels.mlr_attention(*leaves, **kw, backend="reference")
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).cuda()
    ref_grads = torch.autograd.grad(ref, leaves, dy)
    for backend in backends:
        out = kernels.mlr_attention(q, k, v, **kw, backend=backend)
        assert _relative_error(out.float(), ref) < TOLERANCE[dtype] / 2, backend
        grads = torch.autograd.grad(out, (q, k, v), dy.to(dtype))
        for name, got, want in zip("qkv", grads, ref_grads):
            assert _relative_error(got.float(), want) < TOLERANCE[dtype], (backend, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_and_conv_backends_on_cuda_match_reference(dtype):
    """Every CUDA backend of gated_rmsnorm and depthwise_conv1d (the Triton kernels among them) against the float64
    reference at ViT-B's Hydra sizes (batch 64, 197 tokens, width 1536; 1664 channels, kernel 7), with gradients."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to("cuda", dtype).requires_grad_(True)

    cases = {"norm": ((r(64, 197, 1536), r(64, 197, 1536, scale=2.0), r(1536) + 1),
                      lambda *t, backend: kernels.gated_rmsnorm(*t, 1e-5, False, backend=backend)),
             "conv": ((r(64, 197, 1664), r(1664, 7, scale=0.3), r(1664)),
                      lambda *t, backend: kernels.depthwise_conv1d(*t, causal=False, silu=True, backend=backend))}
    for op, (inputs, fn) in cases.items():
        assert "triton" in _gpu_backends(op)
        leaves = [t.detach().double().requires_grad_(True) for t in inputs]
        ref = fn(*leaves, backend="reference")
        dy = torch.randn(ref.shape, generator=g, dtype=torch.float64).cuda()
        ref_grads = torch.autograd.grad(ref, leaves, dy)
        for backend in _gpu_backends(op):
            out = fn(*inputs, backend=backend)
            assert _relative_error(out.float(), ref) < TOLERANCE[dtype] / 2, (op, backend)
            for i, (got, want) in enumerate(zip(torch.autograd.grad(out, inputs, dy.to(dtype)), ref_grads)):
                assert _relative_error(got.float(), want) < TOLERANCE[dtype], (op, backend, i)


def test_triton_norm_and_conv_past_2_31_elements():
    """The Triton norm and conv on bfloat16 tensors of more than 2^31 elements (64-bit offsets: one row or time
    step times its stride passes 2^31): the last rows equal the reference computed on them alone."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, width = 2**31 // 1024 + 3, 1024
    y = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.ones(width, device="cuda", dtype=torch.bfloat16)
    out = kernels.gated_rmsnorm(y, y, w, backend="triton")
    tail = y[-5:].double()
    want = kernels.gated_rmsnorm(tail, tail, w.double(), backend="reference")
    assert _relative_error(out[-5:].float(), want) < TOLERANCE[torch.bfloat16] / 2
    del y, out
    x = torch.randn(1, 2**31 // 1664 + 5, 1664, device="cuda", dtype=torch.bfloat16, generator=g)
    wc = torch.randn(1664, 4, device="cuda", dtype=torch.bfloat16, generator=g)
    out = kernels.depthwise_conv1d(x, wc, None, causal=True, silu=True, backend="triton")
    # causal, kernel 4: the last 60 rows of a 64-row slice have their whole window inside it
    want = kernels.depthwise_conv1d(x[:, -64:].double(), wc.double(), None, causal=True, silu=True,
                                    backend="reference")
    assert _relative_error(out[:, -60:].float(), want[:, -60:]) < TOLERANCE[torch.bfloat16] / 2


def test_mamba_ssm_backend_runs_where_mamba_ssm_is_installed():
    """A wheel built with MAMBA_SKIP_CUDA_BUILD=TRUE (no CUDA extensions) is imported through the test shim
    (``tests/mamba_files.py``); the library's backend then imports its SSD the ordinary way."""
    import mamba_files

    if mamba_files.install() is None:
        pytest.skip("mamba-ssm is not installed here (benchmarks/gpu/run.sh installs the carried wheel)")
    assert "mamba_ssm" in kernels.available_backends("scan", "cuda"), [
        (r.op, r.reason) for r in kernels.backend_report(["cuda"]) if r.backend == "mamba_ssm"]


def _hydra_scan_inputs(batch, length, heads=24, p=64, n=64, dtype=torch.bfloat16, seed=0):
    """A Hydra block's scan arguments (both directions, raw dt with bias and softplus, a diagonal) on CUDA."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    return dict(x=r(batch, length, heads, p), dt=r(batch, length, heads, scale=0.5), A=-torch.rand(heads, device="cuda",
                generator=g) - 0.5, B=r(batch, length, 1, n, scale=0.3), C=r(batch, length, 1, n, scale=0.3),
                dt_bwd=r(batch, length, heads, scale=0.5), B_bwd=r(batch, length, 1, n, scale=0.3),
                C_bwd=r(batch, length, 1, n, scale=0.3), diag=r(batch, length, heads),
                dt_bias=torch.randn(heads, device="cuda", generator=g) * 0.1)


@pytest.mark.parametrize("length", [197, 1000], ids=["one_chunk_vit", "chunked"])
def test_triton_scan_at_a_vit_block_and_past_one_chunk_matches_reference(length):
    """The Triton scan (one-chunk kernels at a ViT's 197 tokens, chunked ones at 1000) with a Hydra block's arguments
    in bfloat16, values and every gradient, against the float64 reference."""
    inputs = {k: v.requires_grad_(True) for k, v in _hydra_scan_inputs(4, length).items()}
    kw = dict(chunk_size=64, dt_softplus=True, shift=True)
    leaves = {k: v.detach().double().requires_grad_(True) for k, v in inputs.items()}
    ref = kernels.quasiseparable(**leaves, **kw, backend="reference")
    out = kernels.quasiseparable(**inputs, **kw, backend="triton")
    assert out.dtype == torch.bfloat16
    assert _relative_error(out.float(), ref) < TOLERANCE[torch.bfloat16] / 2
    dy = torch.randn(ref.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda",
                     dtype=torch.float64)
    grads = torch.autograd.grad(out, list(inputs.values()), dy.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, list(leaves.values()), dy)
    for name, got, want in zip(inputs, grads, ref_grads):
        assert got.dtype == inputs[name].dtype, name
        assert _relative_error(got.float(), want) < 2 * TOLERANCE[torch.bfloat16], name


@pytest.mark.parametrize("batch,length", [(24, 65536), (4096, 197)], ids=["chunked_2^31", "one_chunk_batch_heads"])
def test_triton_scan_past_2_31_elements_and_65535_sequences_times_heads(batch, length):
    """The Triton scan where x has more than 2^31 elements (chunked: 24 x 65,536 tokens x 1,536; its passed states
    too) and where sequences times heads passes 65,535 (one-chunk: 4,096 x 24): the last sequence, forward and
    backward, equals the same kernels run on it alone (64-bit offsets, one-dimensional grids)."""
    inputs = {k: v.requires_grad_(True) for k, v in _hydra_scan_inputs(batch, length).items()}
    kw = dict(chunk_size=64, dt_softplus=True, shift=True, backend="triton")
    if batch * length * 24 * 64 <= 2**31:
        assert batch * 24 > 65_535
    out = kernels.quasiseparable(**inputs, **kw)
    dy = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad(out, [inputs["x"], inputs["B"]], dy)
    last = {k: (v[-1:] if v.dim() > 1 else v).detach().requires_grad_(True) for k, v in inputs.items()}
    want = kernels.quasiseparable(**last, **kw)
    want_grads = torch.autograd.grad(want, [last["x"], last["B"]], dy[-1:])
    assert torch.equal(out[-1:], want)
    for got, ref in zip(grads, want_grads):
        assert torch.equal(got[-1:], ref)


def test_a_hydra_block_runs_under_cuda_graphs():
    """``torch.compile(mode="reduce-overhead")`` (CUDA graphs) of a Hydra block on the Triton path, training steps:
    the same values and gradients as eager (nothing in the Triton path syncs the host or sizes a buffer by values)."""
    torch.manual_seed(0)
    mixer = mp.create_mixer("quasi", 256).cuda()
    compiled = torch.compile(copy.deepcopy(mixer), mode="reduce-overhead", fullgraph=True)
    for step in range(3):
        x = torch.randn(8, 197, 256, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y_e = mixer(x.clone().requires_grad_(True))
            y_c = compiled(x.clone().requires_grad_(True))
        assert _relative_error(y_c.float(), y_e.float()) < TOLERANCE[torch.bfloat16], step
        y_c.float().sum().backward()
        y_e.float().sum().backward()
    for (name, p_e), (_, p_c) in zip(mixer.named_parameters(), compiled.named_parameters()):
        assert _relative_error(p_c.grad.float(), p_e.grad.float()) < 2 * TOLERANCE[torch.bfloat16], name


@pytest.mark.parametrize("name", ["semiseparable", "low_rank", "attention"])
def test_a_decoding_step_is_captured_by_a_cuda_graph(name):
    """A one-token step captured once by ``torch.cuda.CUDAGraph`` and replayed: the same outputs and cache as eager
    steps (static shapes, the cache updated in place, no host sync), the fused step on its Triton kernels."""
    options = {"causal": True} if name != "semiseparable" else {}
    torch.manual_seed(0)
    mixer = mp.create_mixer(name, 256, **options).cuda().eval()
    eager, graphed = mixer.allocate_cache(2, 64), mixer.allocate_cache(2, 64)
    prompt = torch.randn(2, 16, 256, device="cuda")
    x = torch.zeros(2, 1, 256, device="cuda")
    with torch.no_grad():
        mixer.prefill(prompt, eager)
        mixer.prefill(prompt, graphed)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm-up on a side stream (lazy initialisation outside the capture)
            warm = copy.deepcopy(graphed)
            for _ in range(2):
                mixer.step(x, warm)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mixer.step(x, graphed)
        graphed.offset -= 1    # capturing ran no kernel (the cache is where it was) but did count the token
        for _ in range(4):
            x.copy_(torch.randn(2, 1, 256, device="cuda"))
            want = mixer.step(x, eager)
            graph.replay()
            graphed.offset += 1
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    for key, tensor in eager.state.items():
        torch.testing.assert_close(graphed.state[key], tensor, rtol=1e-4, atol=1e-4)


def test_launches_per_hydra_block_on_cuda():
    """The CUDA kernels of one Hydra mixer's forward and backward at ViT-B's sizes, float32, from the profiler: at
    most 40 (as the CPU trace in tests/ops/test_scan_triton.py asserts)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "launches.py"
    spec = importlib.util.spec_from_file_location("gpu_launches", path)
    launches = importlib.util.module_from_spec(spec)
    sys.modules["gpu_launches"] = launches
    spec.loader.exec_module(launches)
    mixer = launches.hydra_block(768).cuda()
    x = torch.randn(8, 197, 768, device="cuda", requires_grad=True)
    step = launches.block_step(mixer, x)
    step()
    counts = launches.count_launches(step, profiler=True)
    assert counts.total <= 40, counts.table()
