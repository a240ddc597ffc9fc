/* The emulated link's copy thread, in C: both directions' copies move on one thread that never needs the GIL.
 *
 * Each direction (0: remote -> device, 1: device -> remote) is a FIFO of copies with its own ideal clock: a copy
 * starts at the latest of the moment it was issued, the ideal end of the direction's previous copy and the ideal
 * end of the copy it depends on, and ends latency + bytes / bandwidth later (or as long after as the memmove
 * itself took, if the memory system is slower than the link). The thread moves a copy's bytes as soon as it
 * reaches it, taking next the head of the direction whose ideal start comes first (next_direction; a copy that
 * depends on one of the other direction comes after it); a copy *completes* at its ideal end.
 *
 * The thread spins for `spin_s` seconds after its last copy before it sleeps on a condition variable, and a
 * waiting caller spins before it sleeps: on a virtual machine, waking a thread whose processor has halted costs
 * tens of microseconds, which a step issuing hundreds of copies cannot pay on every copy.
 *
 * Sequence numbers count each direction's copies from 1; `done[d]` is the newest copy of direction d whose bytes
 * have moved. A copy's times stay readable until RING later copies of its direction have been issued.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RING 65536u

#if defined(__x86_64__) || defined(__i386__)
#define PAUSE() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define PAUSE() __asm__ __volatile__("yield")
#else
#define PAUSE() ((void)0)
#endif

typedef struct {
    void *dst;
    const void *src;
    size_t nbytes;
    int after_dir;        /* -1: depends on no copy */
    int64_t after_seq;
    double issued_s, start_s, end_s;
} Copy;

typedef struct {
    Copy ring[RING];
    _Atomic int64_t issued; /* sequence number of the newest copy issued */
    _Atomic int64_t done;   /* ... and of the newest whose bytes have moved */
    double bandwidth, latency_s, clock_s, busy_s, moving_s;
} Direction;

typedef struct {
    Direction dir[2];
    double spin_s;
    _Atomic int stop, sleeping;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_mutex_t submitting; /* callers in several threads issue one copy at a time */
    pthread_t thread;
} Link;

static double ho_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* Python's time.perf_counter on Linux */
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int pending(Link *link, int d) {
    return atomic_load_explicit(&link->dir[d].issued, memory_order_acquire) >
           atomic_load_explicit(&link->dir[d].done, memory_order_relaxed);
}

/* The direction whose next copy an ideal duplex link would start first, or -1 if neither has one: the earlier of
 * the two heads' ideal starts were they moved now (the later of the copy's issue and its direction's clock), and a
 * copy that depends on the other direction's copy not moved yet goes after that copy. Moving the copies in the
 * order they were issued instead made a device -> remote copy wait behind a queue of remote -> device copies its
 * own direction's clock never waited for, and a release waiting for it wait that long too. */
static int next_direction(Link *link) {
    int a = pending(link, 0), b = pending(link, 1);
    if (!a && !b) return -1;
    if (a != b) return a ? 0 : 1;
    double start[2];
    for (int d = 0; d < 2; d++) {
        Direction *dir = &link->dir[d];
        Copy *c = &dir->ring[(uint64_t)(dir->done + 1) % RING];
        if (c->after_dir == 1 - d &&
            atomic_load_explicit(&link->dir[1 - d].done, memory_order_acquire) < c->after_seq)
            return 1 - d;
        start[d] = c->issued_s > dir->clock_s ? c->issued_s : dir->clock_s;
    }
    return start[0] <= start[1] ? 0 : 1;
}

static void move_one(Link *link, int d) {
    Direction *dir = &link->dir[d];
    int64_t seq = dir->done + 1;
    Copy *c = &dir->ring[(uint64_t)seq % RING];
    double start = c->issued_s > dir->clock_s ? c->issued_s : dir->clock_s;
    if (c->after_dir >= 0) {
        Direction *other = &link->dir[c->after_dir];
        /* Moved already: next_direction takes it first (or, when other is this direction, it is an earlier copy). */
        while (atomic_load_explicit(&other->done, memory_order_acquire) < c->after_seq) PAUSE();
        if (other->issued - c->after_seq < (int64_t)RING) {
            double after_end = other->ring[(uint64_t)c->after_seq % RING].end_s;
            if (after_end > start) start = after_end;
        }
    }
    double t0 = ho_now();
    if (c->nbytes) memmove(c->dst, c->src, c->nbytes);
    double copied_s = ho_now() - t0;
    double ideal = dir->latency_s + (double)c->nbytes / dir->bandwidth;
    double end = start + (ideal > copied_s ? ideal : copied_s);
    c->start_s = start;
    c->end_s = end;
    dir->busy_s += end - start;
    dir->moving_s += copied_s;
    dir->clock_s = end;
    atomic_store_explicit(&dir->done, seq, memory_order_release);
}

static void *run(void *arg) {
    Link *link = arg;
    double idle_since = ho_now();
    for (;;) {
        int d = next_direction(link);
        if (d >= 0) {
            move_one(link, d);
            idle_since = ho_now();
            continue;
        }
        if (atomic_load(&link->stop)) return NULL;
        if (ho_now() - idle_since < link->spin_s) {
            for (int i = 0; i < 64; i++) PAUSE();
            continue;
        }
        pthread_mutex_lock(&link->lock);
        atomic_store(&link->sleeping, 1);
        /* Checked again after saying so: a copy issued before the caller could see `sleeping` is seen here. */
        if (next_direction(link) < 0 && !atomic_load(&link->stop)) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += 100 * 1000 * 1000; /* a safety net: a copy issued now signals */
            if (until.tv_nsec >= 1000000000L) { until.tv_sec += 1; until.tv_nsec -= 1000000000L; }
            pthread_cond_timedwait(&link->wake, &link->lock, &until);
        }
        atomic_store(&link->sleeping, 0);
        pthread_mutex_unlock(&link->lock);
        idle_since = ho_now();
    }
}

void *ho_create(double h2d_bw, double d2h_bw, double h2d_latency_s, double d2h_latency_s, double spin_s) {
    Link *link = calloc(1, sizeof(Link));
    if (!link) return NULL;
    link->dir[0].bandwidth = h2d_bw;
    link->dir[1].bandwidth = d2h_bw;
    link->dir[0].latency_s = h2d_latency_s;
    link->dir[1].latency_s = d2h_latency_s;
    link->spin_s = spin_s;
    pthread_mutex_init(&link->lock, NULL);
    pthread_cond_init(&link->wake, NULL);
    pthread_mutex_init(&link->submitting, NULL);
    if (pthread_create(&link->thread, NULL, run, link) != 0) {
        free(link);
        return NULL;
    }
    return link;
}

/* Issue a copy of `nbytes` from `src` to `dst` on direction `d` after copy `after_seq` of direction `after_dir`
 * (-1: none); returns its sequence number. Blocks while RING copies of the direction are unmoved. */
int64_t ho_submit(void *handle, int d, void *dst, const void *src, size_t nbytes, int after_dir, int64_t after_seq) {
    Link *link = handle;
    Direction *dir = &link->dir[d];
    pthread_mutex_lock(&link->submitting);
    int64_t seq = atomic_load_explicit(&dir->issued, memory_order_relaxed) + 1;
    while (seq - atomic_load_explicit(&dir->done, memory_order_acquire) > (int64_t)RING) PAUSE();
    Copy *c = &dir->ring[(uint64_t)seq % RING];
    c->dst = dst;
    c->src = src;
    c->nbytes = nbytes;
    c->after_dir = after_dir;
    c->after_seq = after_seq;
    c->issued_s = ho_now();
    c->start_s = c->end_s = 0.0;
    atomic_store(&dir->issued, seq);
    pthread_mutex_unlock(&link->submitting);
    if (atomic_load(&link->sleeping)) {
        pthread_mutex_lock(&link->lock);
        pthread_cond_signal(&link->wake);
        pthread_mutex_unlock(&link->lock);
    }
    return seq;
}

static int ho_moved(void *handle, int d, int64_t seq) {
    Link *link = handle;
    return atomic_load_explicit(&link->dir[d].done, memory_order_acquire) >= seq;
}

/* The ideal end of a moved copy (seconds on ho_now's clock); 0 once its slot has been reused. */
static double ho_end(void *handle, int d, int64_t seq) {
    Link *link = handle;
    Direction *dir = &link->dir[d];
    if (atomic_load(&dir->issued) - seq >= (int64_t)RING) return 0.0;
    return dir->ring[(uint64_t)seq % RING].end_s;
}

/* The ideal end of copy `seq` if its bytes have moved, else -1: one call for a poll. */
double ho_poll(void *handle, int d, int64_t seq) {
    Link *link = handle;
    return ho_moved(link, d, seq) ? ho_end(link, d, seq) : -1.0;
}

/* The ideal start of a moved copy, as ho_end. */
double ho_start(void *handle, int d, int64_t seq) {
    Link *link = handle;
    Direction *dir = &link->dir[d];
    if (atomic_load(&dir->issued) - seq >= (int64_t)RING) return 0.0;
    return dir->ring[(uint64_t)seq % RING].start_s;
}

static void sleep_s(double s) {
    struct timespec t = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&t, NULL);
}

/* Block until copy `seq` of direction `d` has moved its bytes and, with `complete`, reached its ideal end.
 * Spins for up to `spin_s`, then sleeps in short naps. Returns the ideal end. */
double ho_wait(void *handle, int d, int64_t seq, int complete, double spin_s) {
    Link *link = handle;
    double began = ho_now();
    while (!ho_moved(link, d, seq)) {
        if (ho_now() - began < spin_s) PAUSE();
        else sleep_s(20e-6);
    }
    double end = ho_end(link, d, seq);
    if (!complete) return end;
    for (double left = end - ho_now(); left > 0; left = end - ho_now()) {
        if (left > spin_s) sleep_s(left - spin_s);
        else PAUSE();
    }
    return end;
}

double ho_busy(void *handle, int d) {
    Link *link = handle;
    return link->dir[d].busy_s;
}

/* Seconds the thread spent in memmove for direction d, over the link's life. */
double ho_moving(void *handle, int d) {
    Link *link = handle;
    return link->dir[d].moving_s;
}

/* Move every copy issued so far, stop the thread and free the link. */
void ho_destroy(void *handle) {
    Link *link = handle;
    atomic_store(&link->stop, 1);
    pthread_mutex_lock(&link->lock);
    pthread_cond_signal(&link->wake);
    pthread_mutex_unlock(&link->lock);
    pthread_join(link->thread, NULL);
    pthread_mutex_destroy(&link->lock);
    pthread_cond_destroy(&link->wake);
    pthread_mutex_destroy(&link->submitting);
    free(link);
}
