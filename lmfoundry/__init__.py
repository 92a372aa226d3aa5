"""lmfoundry: quantize, compile, serve and quality-gate open-weights LLMs.

The stages live in subpackages (`lmfoundry.quantizers`, `.calibration`, `.compile`, `.kernels`,
`.runtime`, `.evals`) that map to the repository's top-level folders; this package holds the CLI
and what every stage shares (model resolution, the manifest, recipes, errors).
"""

__version__ = "0.1.0"
