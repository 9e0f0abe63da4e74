"""``torch.compile`` with inductor against eager, for the compile tests (tests/test_compile_models.py and the
fairseq2 encoder's in tests/test_fairseq2.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

TOL = dict(rtol=1e-4, atol=1e-5)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


@contextlib.contextmanager
def inductor_settings() -> Iterator[None]:
    """One compile per graph: no recompiles for dynamic shapes (every call has the same shapes); compile in this
    process (starting a pool of workers costs more than it saves on a small runner)."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, cache_size_limit=8), \
            inductor_config.patch(compile_threads=1):
        yield
    torch._dynamo.reset()


@contextlib.contextmanager
def dropout_off(module: nn.Module) -> Iterator[None]:
    """Dropout probabilities set to 0 for a while (``nn.Dropout`` modules and float ``dropout`` attributes): the
    compiled graph draws its random numbers in another order than eager, so training is compared without them."""
    saved = []
    for sub in module.modules():
        for attr in ("p", "dropout", "attn_dropout"):
            value = getattr(sub, attr, None)
            if isinstance(value, float) and value > 0 and (attr != "p" or isinstance(sub, nn.Dropout)):
                saved.append((sub, attr, value))
                setattr(sub, attr, 0.0)
    try:
        yield
    finally:
        for sub, attr, value in saved:
            setattr(sub, attr, value)


def assert_train_and_eval_match(module: nn.Module, inputs: tuple, loss_fn, *, fullgraph: bool = True) -> None:
    """A training step (loss, every parameter gradient) and an eval forward of ``torch.compile(module)`` equal
    eager's. Training is compared with dropout off (see :func:`dropout_off`); eval runs with the module's dropout
    probabilities, which eval must ignore."""
    compiled = torch.compile(module, backend="inductor", fullgraph=fullgraph)
    module.train()
    results = []
    with dropout_off(module):
        for run in (module, compiled):
            loss = loss_fn(run(*inputs))
            loss.backward()
            results.append((loss.detach(), _grads(module)))
    (loss_e, grads_e), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, **TOL)
    assert grads_c.keys() == grads_e.keys() and grads_e
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-3, atol=1e-4, msg=name)
    module.eval()
    with torch.no_grad():
        torch.manual_seed(7)
        expected = module(*inputs)
        torch.manual_seed(8)  # another seed: eval must not depend on the random state (dropout off)
        torch.testing.assert_close(compiled(*inputs), expected, **TOL)


