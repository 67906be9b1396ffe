#!/usr/bin/env bash
# Fresh machine to first result: install (torch pinned first), then discover this machine,
# show a real 8-GPU NVSwitch node, place a TP x PP layout on two real H100 hosts, and
# launch two local workers that read the topology file topomesh builds during the
# torchrun rendezvous.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out="${TOPOMESH_DEMO_DIR:-$(mktemp -d)}"
echo "== topomesh discover (this machine)"
python3 -m topomesh discover -o "$out/this-host.json"
echo
echo "== topomesh show: NCCL topology dump of an 8x A100 NVSwitch node"
python3 -m topomesh show examples/data/real/nccl-topo/a100-sxm-8gpu-nvswitch-5nic.xml
echo
echo "== topomesh layout: tp=8 x pp=2 on two such H100 hosts whose ranks are numbered round-robin"
python3 -m topomesh layout examples/data/real/nvidia-smi-topo/h100-sxm-8gpu-12nic.txt \
  --hosts 2 --rank-order round-robin --tp 8 --pp 2
if python3 -c "import topomesh.launch.cli" 2>/dev/null; then
  echo
  echo "== topomesh launch --standalone --nproc-per-node 2: every worker reads WORLD_TOPOLOGY_FILE"
  python3 -m topomesh launch --standalone --nproc-per-node 2 --log-dir "$out/logs" \
    examples/print_topology.py
fi
echo
echo "== topomesh plan: llama3-8b on 64 H100s (8 DGX nodes), tp=8: every layout of pp and data parallel, the best 5"
python3 -m topomesh plan --model llama3-8b --cluster dgx-h100 --gpus 64 --global-batch 256 --tp 8 \
  --strategies tp,pp,dp_shard,dp_replicate --top 5 --html "$out/plan-llama3-8b.html"
echo
echo "== topomesh plan: tiny-llama for this machine (2 CPU ranks), then launch its best layout and train 3 steps"
python3 -m topomesh discover --nproc 2 -o "$out/this-host-2.json" > /dev/null
python3 -m topomesh plan --model tiny-llama --topology "$out/this-host-2.json" --device cpu \
  --strategies tp,dp_shard --top 3 -o "$out/plan.json"
python3 -m topomesh launch --standalone --nproc-per-node 2 --log-dir "$out/logs-plan" --plan "$out/plan.json" \
  examples/train_plan.py --steps 3
echo
echo "files written under $out"
