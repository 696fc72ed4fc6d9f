"""Launch, an optional part: where each process runs (`allocation`, the --allocation grammar;
`placement`, each process's node and devices),
SLURM jobs (`slurm`), leases on servers several runs share (`lease`) and a recipe's --dry-run
(`recipe`). The core loads it only when one of those is asked for."""
