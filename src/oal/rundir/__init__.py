"""The run directory on disk: atomic files (`files`), hashes (`hashes`), stage records (`stages`), one
configuration per directory (`claim`), metrics.json from verified records (`metrics`), writes confined to the
directory (`confine`) and one writer at a time (`lock`). Below every other stage package."""
