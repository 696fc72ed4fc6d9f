"""Launch, an optional part: the --allocation grammar (`allocation`), each process's node and
devices (`placement`), SLURM jobs (`slurm`), leases on servers several runs share (`lease`) and
a recipe's --dry-run (`recipe`). The core loads it only when one of those is asked for."""
