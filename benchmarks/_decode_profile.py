"""`benchmarks.generate --profile`: where one decoding step goes, per layer type (torch.profiler).

Forward hooks open a profiler range around each attention module (named after its layer's method, or softmax),
each MLP, the norms and the LM head; the step itself is one more range. The table gives, per range, the time per
step and per module call (inclusive: a range holds the operators it runs); "other" is the step minus the ranges
(embedding, residual adds, RoPE, HF's bookkeeping). Then the operators with the most self time.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks import _long_context as lc


def _ranges(model, layers: list[int], method: str) -> list:
    """Install the hooks; returns their handles."""
    handles = []

    def wrap(module, name):
        def pre(mod, *_):
            mod._oal_range = record_function(name)
            mod._oal_range.__enter__()

        def post(mod, *_):
            mod._oal_range.__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    wrap(model, "step")
    for i, layer in enumerate(model.model.layers):
        wrap(layer.self_attn, f"attention ({method if i in layers else 'softmax'})")
        wrap(layer.mlp, "mlp")
        wrap(layer.input_layernorm, "norms")
        wrap(layer.post_attention_layernorm, "norms")
    wrap(model.lm_head, "lm_head")
    return handles


def profile_step(args, convert) -> str:
    """One table per method of `args.methods`, at the first shape, context and batch of `args`."""
    shape, context, batch = args.shapes[0], args.contexts[0], int(args.batches[0])
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    cuda = args.device == "cuda"
    out = []
    for method in args.methods:
        model, source = lc.build(shape, weights=args.weights, max_positions=context + 1024, dtype=dtype,
                                 device=args.device)
        layers = convert(model, shape, method)
        cache = lc.long_cache(model, context, batch, prompt=args.prompt)
        lc.decode(model, cache, context, tokens=1, warmup=args.warmup)
        handles = _ranges(model, layers, method)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            lc.decode(model, cache, context + args.warmup + 1, tokens=args.tokens, warmup=0)
        for handle in handles:
            handle.remove()
        events = {e.key: e for e in prof.key_averages()}
        time_of = (lambda e: e.device_time_total) if cuda else (lambda e: e.cpu_time_total)
        step = time_of(events["step"]) / args.tokens / 1e3
        lines = [f"{shape}, {method} ({len(layers)} converted layers), context {context}, batch {batch}, "
                 f"{args.device}, {torch.get_num_threads()} threads: {step:.3f} ms per step ({source})",
                 f"  {'range':28s} {'ms/step':>9s} {'share':>6s} {'calls/step':>10s} {'ms/call':>8s}"]
        named = 0.0
        for key in sorted(k for k in events if k.startswith(("attention", "mlp", "norms", "lm_head"))):
            ms = time_of(events[key]) / args.tokens / 1e3
            calls = events[key].count / args.tokens
            named += ms
            lines.append(f"  {key:28s} {ms:9.3f} {ms / step:6.1%} {calls:10.0f} {ms / calls:8.4f}")
        lines.append(f"  {'other':28s} {step - named:9.3f} {(step - named) / step:6.1%}")
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        lines.append(prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=48))
        out.append("\n".join(lines))
        del model, cache
    return "\n\n".join(out)
