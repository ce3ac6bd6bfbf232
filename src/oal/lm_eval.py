"""`python -m oal.lm_eval ARGS`: lm-eval's own command line (every option: --include_path, --log_samples,
--output_path, batch sizes, ...) with oal's converted model types registered first, so that

    python -m oal.lm_eval --model hf --model_args pretrained=converted/ --tasks piqa

scores the converted model: lm-eval's HFLM loads the folder with AutoModelForCausalLM, which `import oal` taught the
"oal_<family>" types (the folder's hashes are checked on load). Nothing else is changed: the arguments go to
lm-eval's `cli_evaluate` as they are.
"""

from __future__ import annotations

import sys

import oal  # noqa: F401  (registers the oal_* model types with transformers' Auto classes)


def main(argv: list[str] | None = None) -> None:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print("Error: lm-eval is not installed; install it with `pip install 'oal-attention[eval]'` (or `pip install "
              "lm-eval`)", file=sys.stderr)
        raise SystemExit(2) from None
    sys.argv = ["python -m oal.lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
