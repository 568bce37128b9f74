"""HF <-> FP8 / MXFP8 / NVFP4 checkpoint converters, live weight export and the contract verifier.

CLIs: `python -m converters.hf_to_fp8 | hf_to_mxfp8 | hf_to_nvfp4 | fp8_to_bf16 | verify` (each has --help).
Library: `converters.export.export_weights` / `save_exported` (live export), `converters.convert.convert_hf`,
`converters.verify.verify`. Design: docs/decisions/0007-converters.md. Nothing is imported here so that a CLI's
--help stays fast.
"""
