"""Expert parallelism for our PyTorch engine, launched with `mpirun -n N ... --ep N`.

  dist.py     torch.distributed from MPI, launch checks, failure handling
  experts.py  each rank keeps its share of every MoE layer's experts; exact all-reduce
  remote.py   rank 0 drives the engine and broadcasts each target call; others replay it
  run.py      what each rank runs (`moespec generate --ep N`, the runtime launcher)
"""
