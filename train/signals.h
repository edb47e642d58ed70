// Preemption: SIGTERM and SIGUSR1 (what Slurm sends before it kills a job) ask the trainer to
// finish the current step, write a checkpoint and exit 0. A second SIGTERM exits at once
// (status 143) without touching the last good checkpoint.
#pragma once

namespace primus::train {

void install_exit_signal_handlers();
bool exit_requested();           // set by the first SIGTERM/SIGUSR1
int exit_signal();               // which signal asked
void reset_exit_request();       // for tests

}  // namespace primus::train
