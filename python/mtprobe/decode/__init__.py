"""The decode path in Python, beside ``csrc/decode/`` (the C++ loop it drives): :func:`generate` and
:func:`custom_generate` (:mod:`~mtprobe.decode.generate`, read top to bottom), the call they prepare
(:mod:`~mtprobe.decode.call`), each sequence's loop (:mod:`~mtprobe.decode.sequence`) and a batch's rows
together (:mod:`~mtprobe.decode.batch`), what they return (:mod:`~mtprobe.decode.output`), the checks of their inputs (:mod:`~mtprobe.decode.checks`), what
transformers' ``generate`` hands them (:mod:`~mtprobe.decode.hf_call`) and what each of its arguments
does to a generation (:mod:`~mtprobe.decode.hf_arguments`)."""

from mtprobe.decode.generate import custom_generate, generate
from mtprobe.decode.output import GenerateOutput

__all__ = ["GenerateOutput", "custom_generate", "generate"]
