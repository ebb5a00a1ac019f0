"""The target model as the decode loop sees it: the HF adapter (:mod:`~mtprobe.target.adapter`), its
KV cache (:mod:`~mtprobe.target.cache`), the static forward plan (:mod:`~mtprobe.target.plan`), the
mask tokens' hooks and calibration files (:mod:`~mtprobe.target.mask_hooks`,
:mod:`~mtprobe.target.mask_calibration`), the self-drafts made of it
(:mod:`~mtprobe.target.self_draft`) and what its forward costs on this machine
(:mod:`~mtprobe.target.profile`).

It sits above :mod:`mtprobe.cpu` and below the drafters: nothing here knows a decoding method.
"""
