"""The CPU's own floor: what this machine is (:mod:`~mtprobe.cpu.machine`), the small-batch linear op
for verification forwards of a few inputs (:mod:`~mtprobe.cpu.small_batch_linear`), the route each
block size takes through the linear layers (:mod:`~mtprobe.cpu.linear_routes`) and the 4-bit linear
layers of the quantized self-draft (:mod:`~mtprobe.cpu.quantized_linear`).

Nothing here knows a Hugging Face model's structure: :mod:`mtprobe.target_model` applies these to one.
"""
