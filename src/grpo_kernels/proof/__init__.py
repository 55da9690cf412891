"""The accelerator proof's measuring programs (``grpo-kernels proof`` runs each in its own
process as ``python -m grpo_kernels.proof.<name>``; each also runs alone, with ``--help``).

- :mod:`~grpo_kernels.proof.copy_bandwidth`: the device's copy bandwidth, the roofline's ceiling;
- :mod:`~grpo_kernels.proof.device_memory`: one loss step's device peak, in a fresh process;
- :mod:`~grpo_kernels.proof.gpu_layouts`: the GPU kernel layouts and tilings against each other;
- :mod:`~grpo_kernels.proof.gpu_train_step`: the trainer's update per loss arm;
- :mod:`~grpo_kernels.proof.gpu_tunix_step`: tunix's update and log-prob pass, its loss and ours;
- :mod:`~grpo_kernels.proof.head_gradcheck`: the fused head's gradients at a real shape;
- :mod:`~grpo_kernels.proof.liger_peer`: our losses beside Liger-Kernel's, on a GPU or the CPU;
- :mod:`~grpo_kernels.proof.shapes` and :mod:`~grpo_kernels.proof.timing`: what they share.
"""
