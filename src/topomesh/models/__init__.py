"""Built-in models: the reference transformer (:mod:`.transformer`), published shapes
(:mod:`.presets`) and torchtitan-style parallelize functions (:mod:`.parallelize`)."""
