"""The target model as the decode loop sees it: the HF adapter (:mod:`~mtprobe.target_model.adapter`), its
KV cache (:mod:`~mtprobe.target_model.cache`), the static forward plan (:mod:`~mtprobe.target_model.plan`), the
mask tokens' hooks and calibration files (:mod:`~mtprobe.target_model.mask_hooks`,
:mod:`~mtprobe.target_model.mask_calibration`), the self-drafts made of it
(:mod:`~mtprobe.target_model.self_draft`) and what its forward costs on this machine
(:mod:`~mtprobe.target_model.profile`).

It sits above :mod:`mtprobe.cpu` and below the drafters: nothing here knows a decoding method.
"""
