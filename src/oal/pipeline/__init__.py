"""`oal run` and the commands that change part of a run: the stage mechanism (`base`), the decoder and encoder
protocols (`decoder`, `encoder`), layer selection (`selection`), one or several seeds (`runs`, `aggregate`), the
configuration (`config`), `oal evaluate` on a run directory (`evaluate_*`), the report (`report*`), and the inputs
the commands share (`inputs`).

    from oal.pipeline.config import RunConfig
    from oal.pipeline.runs import run
    metrics = run(RunConfig.from_preset("default"), "runs/default")
"""
