/*
 * Binding the OpenMP threads of the calling thread's team to cores (kernels/cpu/threads.py).
 *
 * The library is linked against torch's OpenMP runtime (build.py), so the team started here is the
 * team torch's operators and the other kernels run on: the calling thread (thread 0) and the pool
 * threads the runtime keeps for it and hands the same slots again in every later parallel region of
 * at most that many threads. Binding thread i of one region to cpus[i] therefore binds thread i of
 * every later one, which no environment variable can do once the runtime has started (OMP_PLACES,
 * OMP_PROC_BIND and GOMP_CPU_AFFINITY are read when it loads, i.e. when torch is imported).
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/*
 * Run one parallel region of n threads; thread i binds itself to cpus[i] when bind is non-zero and
 * writes its kernel thread id to tids[i] (0 for a slot the runtime did not fill). Returns the
 * number of threads the team had, or -(1 + i) when thread i could not be bound.
 */
int32_t warmcap_bind_team(const int32_t *cpus, int32_t n, int32_t bind, int64_t *tids)
{
    int32_t team = 0, failed = -1;
    for (int32_t i = 0; i < n; i++)
        tids[i] = 0;
#pragma omp parallel num_threads(n)
    {
        const int me = omp_get_thread_num();
#pragma omp single
        team = omp_get_num_threads();
        if (me < n) {
            tids[me] = (int64_t)syscall(SYS_gettid);
            if (bind) {
                cpu_set_t set;
                CPU_ZERO(&set);
                CPU_SET(cpus[me], &set);
                if (sched_setaffinity(0, sizeof set, &set) != 0) {
#pragma omp critical
                    if (failed < 0 || me < failed)
                        failed = me;
                }
            }
        }
    }
    return failed >= 0 ? -(1 + failed) : team;
}
