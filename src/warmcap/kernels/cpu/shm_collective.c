/*
 * The tensor-parallel all-reduce (sum) of float32 tensors over the ranks' shared-memory segment, as
 * one C call (distributed/shm_comm.py, whose Python collective it mirrors word for word), and the
 * one-way mailbox a helper rank posts a peer's K/V projections through (models/llama.py KVOffload).
 *
 * Why in C: a recorded CPU graph (graphs/capture/cpu_program.py) replays a forward as the C calls
 * its operators made, with their arguments as recorded. A collective whose waits and sequence
 * number live in Python cannot be replayed that way; this one keeps all of its state in the segment
 * (the rank's sequence number is read from its header line and bumped here), so the same call with
 * the same arguments is the next collective every time it is made.
 *
 * The segment's layout and protocol are distributed/shm_segment.py's: int64 header words, one
 * 128-byte line per rank after line 0 (fields PID, SEQ, CLOSED, SLEEPING), two data buffers per
 * rank (even and odd collective), a waiter that sleeps on a peer's word announcing it in its own
 * SLEEPING word (word index + 1) and a writer that wakes the address when it sees that. Python's and
 * this code's waits and wakes interoperate, so a collective made in Python (the all-gather) and one
 * made here follow each other on the same sequence numbers.
 *
 * Returns 0, or why it could not finish: WARMCAP_SHM_CLOSED + r (rank r left the group),
 * WARMCAP_SHM_GONE + r (rank r's process is gone or a zombie), WARMCAP_SHM_TIMEOUT.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define WORDS_PER_LINE 16
#define F_PID 0
#define F_SEQ 1
#define F_CLOSED 2
#define F_SLEEPING 5
#define F_MAIL 6
#define F_TAKEN 7
#define SPIN_POLLS 64
#define SPIN_MAX_NS 500000L
#define CHECK_NS 10000000L
#define WARMCAP_SHM_CLOSED 1000
#define WARMCAP_SHM_GONE 2000
#define WARMCAP_SHM_TIMEOUT 3000

/* The constants above, for the Python side to compare with its own at load. */
void warmcap_shm_layout(int64_t *out)
{
    out[0] = WORDS_PER_LINE;
    out[1] = F_PID;
    out[2] = F_SEQ;
    out[3] = F_CLOSED;
    out[4] = F_SLEEPING;
    out[5] = WARMCAP_SHM_CLOSED;
    out[6] = WARMCAP_SHM_GONE;
    out[7] = WARMCAP_SHM_TIMEOUT;
    out[8] = F_MAIL;
    out[9] = F_TAKEN;
}

/* The adaptive spin of shm_segment.py (SPIN_MAX_S, SPIN_SHARE_WEIGHT): per process, as there. */
static double short_share = 1.0;
static int spinning = 1;

static void record_wait(int is_short)
{
    short_share += ((double)is_short - short_share) / 8.0;
    spinning = short_share >= 0.5;
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static int64_t *word(int64_t *words, int64_t rank, int field)
{
    return words + (1 + rank) * WORDS_PER_LINE + field;
}

static int64_t load(int64_t *w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }

/* The futex word of an int64 word: its low 32 bits. */
static uint32_t *low_half(int64_t *w)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return (uint32_t *)w;
#else
    return (uint32_t *)w + 1;
#endif
}

/* Whether process pid runs (a zombie counts as gone), as shm_segment.pid_alive decides it. */
static int pid_alive(int64_t pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return 0;
        return !(kill((pid_t)pid, 0) != 0 && errno == ESRCH);
    }
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 1;
    buf[n] = 0;
    char *paren = strrchr(buf, ')');
    if (paren == NULL || paren[1] == 0 || paren[2] == 0)
        return 1;
    return paren[2] != 'Z' && paren[2] != 'X';
}

static int64_t check_peers(int64_t *words, int64_t rank, int64_t world)
{
    for (int64_t r = 0; r < world; r++) {
        if (r == rank)
            continue;
        if (load(word(words, r, F_CLOSED)))
            return WARMCAP_SHM_CLOSED + r;
        int64_t pid = load(word(words, r, F_PID));
        if (pid && !pid_alive(pid))
            return WARMCAP_SHM_GONE + r;
    }
    return 0;
}

/* Wait until rank peer's field reaches target (shm_segment.Segment.wait_at_least). */
static int64_t wait_field(int64_t *words, int64_t rank, int64_t world, int64_t peer, int field,
                          int64_t target, int64_t timeout_ms)
{
    int64_t *w = word(words, peer, field);
    for (int i = 0; i < SPIN_POLLS; i++)
        if (load(w) >= target)
            return 0;
    const int64_t start = now_ns();
    if (spinning) {
        while (now_ns() - start < SPIN_MAX_NS)
            if (load(w) >= target) {
                record_wait(1);
                return 0;
            }
    }
    int64_t *flag = word(words, rank, F_SLEEPING);
    const int64_t index = w - words;
    int64_t status = 0, check_at = start + CHECK_NS;
    for (;;) {
        __atomic_store_n(flag, index + 1, __ATOMIC_SEQ_CST);
        int64_t seen = __atomic_load_n(w, __ATOMIC_SEQ_CST);
        if (seen >= target)
            break;
        struct timespec ts = {0, CHECK_NS};
        syscall(SYS_futex, low_half(w), FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
        if (load(w) >= target)
            break;
        int64_t now = now_ns();
        if (now >= check_at) {
            status = check_peers(words, rank, world);
            if (status)
                break;
            if (timeout_ms >= 0 && now - start > timeout_ms * 1000000L) {
                status = WARMCAP_SHM_TIMEOUT;
                break;
            }
            check_at = now + CHECK_NS;
        }
    }
    __atomic_store_n(flag, 0, __ATOMIC_SEQ_CST);
    record_wait(now_ns() - start < SPIN_MAX_NS);
    return status;
}

/* Publish this rank's field and wake a peer asleep on it (shm_segment.Segment.set). */
static void publish(int64_t *words, int64_t rank, int64_t world, int field, int64_t value)
{
    int64_t *w = word(words, rank, field);
    __atomic_store_n(w, value, __ATOMIC_SEQ_CST);
    const int64_t index = w - words;
    for (int64_t r = 0; r < world; r++) {
        if (r != rank && __atomic_load_n(word(words, r, F_SLEEPING), __ATOMIC_SEQ_CST) == index + 1) {
            syscall(SYS_futex, low_half(w), FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
            return;
        }
    }
}

/*
 * x[0:n] = the sum over the ranks of their x, in rank order (x_0 + x_1 + ...: every rank the same
 * bits, the Python collective's), through the segment at words; data_offset / data_bytes: where the
 * ranks' buffers start and each one's size (a longer x goes in chunks, one collective each).
 * timeout_ms < 0: no deadline.
 */
int64_t warmcap_shm_all_reduce_f32(float *x, int64_t n, int64_t *words, int64_t rank, int64_t world,
                                   int64_t data_offset, int64_t data_bytes, int64_t timeout_ms)
{
    char *base = (char *)words;
    const int64_t per = data_bytes / (int64_t)sizeof(float);
    for (int64_t start = 0; start < n; start += per) {
        const int64_t m = n - start < per ? n - start : per;
        const int64_t seq = load(word(words, rank, F_SEQ)) + 1;
        const int64_t phase = seq & 1;
        float *mine = (float *)(base + data_offset + (2 * rank + phase) * data_bytes);
        memcpy(mine, x + start, (size_t)m * sizeof(float));
        publish(words, rank, world, F_SEQ, seq);
        for (int64_t r = 0; r < world; r++) {
            if (r == rank)
                continue;
            int64_t status = wait_field(words, rank, world, r, F_SEQ, seq, timeout_ms);
            if (status)
                return status;
        }
        const float *b0 = (const float *)(base + data_offset + phase * data_bytes);
        const float *b1 = (const float *)(base + data_offset + (2 + phase) * data_bytes);
        float *out = x + start;
        for (int64_t i = 0; i < m; i++)
            out[i] = b0[i] + b1[i];
        for (int64_t r = 2; r < world; r++) {
            const float *br = (const float *)(base + data_offset + (2 * r + phase) * data_bytes);
            for (int64_t i = 0; i < m; i++)
                out[i] += br[i];
        }
    }
    return 0;
}

/*
 * The mailbox: this rank has written its next message into its own mailbox (plain stores, before
 * this call); count it posted (MAIL += 1) and wake the peer asleep on it. The release store orders
 * the message before the count.
 */
void warmcap_shm_post(int64_t *words, int64_t rank, int64_t world)
{
    publish(words, rank, world, F_MAIL, load(word(words, rank, F_MAIL)) + 1);
}

/*
 * Wait for rank peer's next message (its MAIL reaching this rank's TAKEN + 1), then count it taken;
 * after it the message in peer's mailbox is readable here. The peer writes its next message only
 * after a collective this rank enters once it is done with this one (the o projection's
 * all-reduce), so one mailbox serves without a second phase. Returns 0 or a status as the
 * all-reduce does.
 */
int64_t warmcap_shm_fetch(int64_t *words, int64_t rank, int64_t world, int64_t peer, int64_t timeout_ms)
{
    int64_t *taken = word(words, rank, F_TAKEN);
    const int64_t target = load(taken) + 1;
    int64_t status = wait_field(words, rank, world, peer, F_MAIL, target, timeout_ms);
    if (status)
        return status;
    __atomic_store_n(taken, target, __ATOMIC_RELEASE);
    return 0;
}
