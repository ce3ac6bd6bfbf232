"""The run directory on disk: atomic files (`files`), hashes (`hashes`), stage records (`stages`), one
configuration per directory (`claim`) and metrics.json (`metrics`). Below every other stage package."""
