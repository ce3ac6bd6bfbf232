"""The converted model as an artefact: a run's arms as models (`arms`), the exported folder (`export`), reloading
(`load`: `oal.load`) and the authors' released calibrations (`authors_format`)."""
