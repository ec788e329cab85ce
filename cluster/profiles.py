"""Hardware profiles: what a serve config and a KubeRay manifest need to know about the nodes.

A profile names the accelerator (Ray resource and Kubernetes device resource), the node shape, the
sequence-parallel degree and the checkpoint. Groups per node = devices per node / sp (SP-4: two per
8-device node; SP-8: one)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    device: str                      # torch device kind of the ranks: cuda | npu
    ray_resource: str                # Ray's resource name: GPU | NPU
    k8s_resource: str                # the device plugin's resource: nvidia.com/gpu | huawei.com/Ascend910
    devices_per_node: int
    sp: int
    preset: str
    model_path: str                  # on the shared model volume, mounted read-only at /models
    image: str
    node_cpus: int
    node_memory_gi: int
    shm_gi: int                      # /dev/shm for the object store (frames rank 0 -> muxer travel through it)
    max_worker_nodes: int
    sessions_per_group: int
    description: str

    @property
    def groups_per_node(self) -> int:
        return self.devices_per_node // self.sp

    def serve_args(self) -> dict:
        """The app's args this profile sets (everything else stays as serve_config.yaml has it)."""
        return {"preset": self.preset, "model_path": self.model_path, "device": self.device, "sp": self.sp,
                "rank_devices": 1, "rank_cpus": 1, "max_sessions_per_group": self.sessions_per_group,
                "min_groups": 1, "max_groups": self.groups_per_node * self.max_worker_nodes}


CUDA_IMAGE = "lingbot-serve:cuda"          # cluster/Dockerfile on rayproject/ray:2.60.0-py311-cu124
NPU_IMAGE = "lingbot-serve:ascend"         # cluster/Dockerfile on a CANN image with torch_npu and Ray 2.60
PROFILES: dict[str, HardwareProfile] = {p.name: p for p in [
    HardwareProfile("h200-sp4", "cuda", "GPU", "nvidia.com/gpu", 8, 4, "lingbot-world-v2-14b",
                    "/models/lingbot-world-v2-14b", CUDA_IMAGE, 96, 1536, 256, 4, 2,
                    "8x H200 (or H100) nodes, two SP-4 groups per node"),
    HardwareProfile("h200-sp8", "cuda", "GPU", "nvidia.com/gpu", 8, 8, "lingbot-world-v2-14b",
                    "/models/lingbot-world-v2-14b", CUDA_IMAGE, 96, 1536, 256, 4, 2,
                    "8x H200 (or H100) nodes, one SP-8 group per node"),
    HardwareProfile("ascend910-sp8", "npu", "NPU", "huawei.com/Ascend910", 8, 8, "lingbot-world-v2-14b",
                    "/models/lingbot-world-v2-14b", NPU_IMAGE, 192, 1536, 256, 4, 2,
                    "8x Ascend 910 nodes (CANN, torch_npu in the image), one SP-8 group per node"),
]}


def get_profile(name: str) -> HardwareProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[name]
