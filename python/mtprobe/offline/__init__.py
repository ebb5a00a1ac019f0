"""The offline builders, a floor above the decode path: what is made once and saved, then read at
decode time. Mask calibration (:mod:`~mtprobe.offline.calibrate`, ``python -m mtprobe calibrate``, from the
sequences of :mod:`~mtprobe.offline.calibration_data`),
circuit-head training (:mod:`~mtprobe.offline.heads`, ``python -m mtprobe heads train``), topology banks
(:mod:`~mtprobe.offline.topology`, ``python -m mtprobe topology``) and the byte-level LM
(:mod:`~mtprobe.offline.bytelm`, ``python -m mtprobe bytelm``).

Each module mirrors its command in :mod:`mtprobe.cli`; the decode path never imports this floor.
"""
