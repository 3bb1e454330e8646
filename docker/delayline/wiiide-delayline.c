/*
 * wiiide-delayline: a delay line for a container whose kernel has no sch_netem.
 *
 * It binds an NFQUEUE queue in the container's own network namespace (the harness's iptables rule
 * queues the packets the container receives, mangle PREROUTING, with --queue-bypass), holds each
 * packet for its delay and then accepts it (the verdict reinjects it where it was queued). The
 * delay of a packet is netem's draw (net/sched/sch_netem.c, tabledist): the delay plus a jitter
 * drawn uniformly in [-jitter, +jitter), or from one of iproute2's distribution tables (normal,
 * pareto, paretonormal: the very files tc hands netem, NETEM_DIST_SCALE 8192), summed over --draws
 * draws. As netem's tfifo, packets leave in the order of their due times: a jitter reorders them.
 *
 * Beside the delay, netem's per-packet impairments that need a verdict of their own, each as
 * net/sched/sch_netem.c draws it (get_crandom's correlated uniform draw, probabilities as u32 / 2^32):
 *   --reorder-pct P [--reorder-corr-pct C] [--gap G]: netem's reorder: once G-1 packets have been
 *     delayed since the last reordered one, a packet is accepted at once (not held) with probability
 *     P; G is 1 unless given (iproute2's default), so every packet may be sent early;
 *   --ge-p-pct p --ge-r-pct r --ge-1h-pct 1-h --ge-1k-pct 1-k: netem's Gilbert-Elliott loss
 *     (loss_gilb_ell): a good and a bad state, good -> bad with probability p, bad -> good with r,
 *     a packet lost with 1-k in the good state and 1-h in the bad one (tc-netem(8), "loss gemodel");
 *   --loss-pct P [--loss-corr-pct C]: netem's random loss with its correlation (loss_event's CLG_RANDOM:
 *     lost when P >= get_crandom(&loss_cor)), the one loss model instead of the Gilbert-Elliott chain;
 *     a lost packet gets the verdict NF_DROP on arrival, before it is held;
 *   --duplicate-pct P [--duplicate-corr-pct C] --dup-mark M: netem's duplicate with its correlation
 *     (netem_enqueue: P >= get_crandom(&dup_cor), drawn before the loss, so a lost packet that was to
 *     be duplicated goes out once). A verdict cannot accept a packet twice: a duplicated packet is
 *     accepted with the mark M (nothing else marks packets in the namespace), and the harness's TEE
 *     rule in mangle INPUT that matches M clones it to the local stack, as iptables' statistic + TEE
 *     does without a correlation.
 * The stats count each: reordered_packets, loss_dropped_packets (and loss_bursts, runs of lost
 * packets in a row).
 *
 * A packet's delay runs from its arrival in the kernel's queue, as netem's runs from its enqueue, not
 * from when this process reads it: a socket with SO_TIMESTAMP (held open, never read) makes the
 * kernel stamp packets (net_enable_timestamp), the queue hands the stamp over (NFQA_TIMESTAMP, wall
 * clock, microseconds) and the due time is the monotonic now less the packet's age plus its delay. A
 * packet without a usable stamp (none, in the future, older than 1 s) is timed from its read; the
 * stats count both (stamped_packets) and how long packets waited to be read (read_wait_*).
 *
 * The queue copies no payload (NFQNL_COPY_META) and takes GSO packets whole (NFQA_CFG_F_GSO), so a
 * 64 KB TSO segment costs one message and one verdict. With no jitter, due times follow arrival and
 * one batch verdict accepts every packet that is due.
 *
 * Modes:
 *   wiiide-delayline --queue N --delay-us D [--jitter-us J] [--distribution NAME] [--draws K]
 *                    [--max-len P]          run in the foreground until SIGTERM/SIGINT
 *   wiiide-delayline --wait-ready [--timeout-s S]  wait for a starting instance to bind its queue
 *   wiiide-delayline --stop                 stop the running instance (SIGTERM, wait, SIGKILL)
 *   wiiide-delayline --check [--queue N]    bind and unbind the queue once (the harness's probe)
 *
 * Files (inside the container): the pid file, the stats file (JSON, rewritten every 250 ms and at
 * exit: packets held, accepted and dropped, the most held at once, CPU seconds of this process,
 * the kernel queue's own drop counters) and the error file of a start that failed.
 * On SIGTERM it accepts every packet it still holds, unbinds and removes its pid file.
 *
 * Build: cc -O2 -o wiiide-delayline wiiide-delayline.c -lnetfilter_queue -lnfnetlink -lm
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef NETLINK_NO_ENOBUFS
#define NETLINK_NO_ENOBUFS 5
#endif
#ifndef SOL_NETLINK
#define SOL_NETLINK 270
#endif

/* queue 0's files; queue N > 0 has its own (wiiide-delayline-N.pid, ...): one instance per queue */
static char PID_FILE[64] = "/tmp/wiiide-delayline.pid", STATS_FILE[64] = "/tmp/wiiide-delayline.json",
            ERROR_FILE[64] = "/tmp/wiiide-delayline.err";
#define NETEM_DIST_SCALE 8192
#define DIST_MAX 16384
#define RCVBUF_BYTES (16 << 20)
#define MAX_MSGS_PER_ROUND 512
#define SLICE_US 100 /* EEVDF's smallest slice */
#define WAKE_LEAD_MAX_NS 1000000ll /* the most the loop wakes before a due time: 1 ms */
#define WAKE_LONG_NS 1000000ull     /* a sleep at least this long (past twice the lead) ends early */
#define STATS_EVERY_NS 250000000ull /* the stats file's age at most: a read right after a trial is current */
#define LATE_BUCKET_NS 10000ull     /* the lateness histogram: 10 us buckets up to 5 ms, the last one open */
#define LATE_BUCKETS 500

struct held { uint64_t due_ns; uint64_t seq; uint32_t id; uint32_t dup; };
struct crnd { uint32_t last, rho; }; /* netem's struct crndstate */

static struct {
    int queue, draws, max_len;
    int64_t delay_ns, jitter_ns;
    const char *distribution;
    short table[DIST_MAX];
    int table_size;
    struct held *heap;
    size_t heap_len, heap_cap;
    uint64_t seq, queued, accepted, dropped_full, max_held;
    int64_t late_total_ns;                /* sum of verdict time - due time (negative: early), accepted packets */
    uint64_t late_max_ns, early_max_ns;   /* the latest and the earliest verdict against its due time */
    int64_t wake_lead_ns;                 /* how long before a due time the loop asks to wake (see main) */
    uint64_t late_hist[LATE_BUCKETS];     /* accepted packets by lateness (LATE_BUCKET_NS wide) */
    uint64_t stamped, read_wait_total_ns, read_wait_max_ns; /* kernel-stamped arrivals, their wait to be read */
    uint64_t rng;
    struct nfq_q_handle *qh;
    volatile sig_atomic_t stop;
    int realtime, nice, slice_us;
    /* reorder (netem: reorder, reorder_cor, gap, counter) and Gilbert-Elliott loss (netem: clg a1..a4) */
    uint32_t reorder, gap, counter;
    struct crnd reorder_cor, loss_cor;
    uint32_t loss;
    double loss_pct, loss_corr_pct;
    struct crnd dup_cor;
    uint32_t duplicate, dup_mark;
    double duplicate_pct, duplicate_corr_pct;
    uint64_t duplicated;
    int ge, ge_bad, last_lost;
    uint32_t ge_p, ge_r, ge_1h, ge_1k;
    double reorder_pct, reorder_corr_pct, ge_pct[4];
    uint64_t reordered, loss_dropped, loss_bursts, ge_bad_entries;
} S;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint32_t rnd32(void) { /* xorshift64*: netem's draws need no more than a uniform 32-bit value */
    S.rng ^= S.rng >> 12; S.rng ^= S.rng << 25; S.rng ^= S.rng >> 27;
    return (uint32_t)((S.rng * 2685821657736338717ull) >> 32);
}

/* netem's get_crandom: a uniform u32, correlated with the last one by rho / 2^32 */
static uint32_t crandom(struct crnd *c) {
    if (c->rho == 0) return rnd32();
    uint64_t rho = (uint64_t)c->rho + 1;
    uint32_t answer = (uint32_t)(((uint64_t)rnd32() * ((1ull << 32) - rho) + (uint64_t)c->last * rho) >> 32);
    c->last = answer;
    return answer;
}

/* a percentage (0..100) as netem's u32 probability, as iproute2's get_percent: rint(p * UINT32_MAX) */
static uint32_t pct_u32(double pct) { return (uint32_t)(pct / 100.0 * 4294967295.0 + 0.5); }

/* netem's loss_gilb_ell: the loss is drawn in the state the packet finds, then the state moves */
static int ge_lost(void) {
    if (!S.ge_bad) {
        if (rnd32() < S.ge_p) { S.ge_bad = 1; S.ge_bad_entries++; }
        return S.ge_1k == UINT32_MAX || (S.ge_1k && rnd32() < S.ge_1k);
    }
    if (rnd32() < S.ge_r) S.ge_bad = 0;
    return S.ge_1h == UINT32_MAX || (S.ge_1h && rnd32() < S.ge_1h);
}

/* netem_enqueue's reorder test: true when this packet goes out at once */
static int reorder_now(void) {
    if (S.gap == 0 || S.counter < S.gap - 1 || S.reorder == 0 || S.reorder < crandom(&S.reorder_cor)) {
        S.counter++;
        return 0;
    }
    S.counter = 0;
    return 1;
}

/* netem's tabledist (net/sched/sch_netem.c), in nanoseconds: mu + a draw of sigma */
static int64_t tabledist(int64_t mu, int64_t sigma) {
    if (sigma == 0) return mu;
    uint32_t r = rnd32();
    if (S.table_size == 0) return (int64_t)(r % (uint64_t)(2 * sigma)) + mu - sigma;
    int64_t t = S.table[r % (uint32_t)S.table_size];
    int64_t x = (sigma % NETEM_DIST_SCALE) * t;
    x += x >= 0 ? NETEM_DIST_SCALE / 2 : -NETEM_DIST_SCALE / 2;
    return x / NETEM_DIST_SCALE + (sigma / NETEM_DIST_SCALE) * t + mu;
}

static int load_table(const char *name, char *err, size_t errlen) {
    static const char *dirs[] = {"/usr/lib/x86_64-linux-gnu/tc", "/usr/lib/aarch64-linux-gnu/tc", "/usr/lib/tc",
                                 "/usr/lib64/tc", "/usr/local/lib/tc", NULL};
    if (name == NULL || strcmp(name, "uniform") == 0) return 0;
    for (int i = 0; dirs[i]; i++) {
        char path[256];
        snprintf(path, sizeof path, "%s/%s.dist", dirs[i], name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        char line[1024];
        while (fgets(line, sizeof line, f) && S.table_size < DIST_MAX) {
            if (line[0] == '#') continue;
            char *p = line, *end;
            for (;;) {
                long v = strtol(p, &end, 10);
                if (end == p) break;
                if (v < -32768 || v > 32767 || S.table_size >= DIST_MAX) {
                    fclose(f);
                    snprintf(err, errlen, "%s: value %ld out of range or table too long", path, v);
                    return -1;
                }
                S.table[S.table_size++] = (short)v;
                p = end;
            }
        }
        fclose(f);
        if (S.table_size == 0) { snprintf(err, errlen, "%s: no values", path); return -1; }
        return 0;
    }
    snprintf(err, errlen, "no %s.dist of iproute2 found (tried /usr/lib/*/tc)", name);
    return -1;
}

static int before(const struct held *a, const struct held *b) {
    return a->due_ns < b->due_ns || (a->due_ns == b->due_ns && a->seq < b->seq);
}

static void heap_push(struct held h) {
    size_t i = S.heap_len++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!before(&h, &S.heap[parent])) break;
        S.heap[i] = S.heap[parent];
        i = parent;
    }
    S.heap[i] = h;
}

static struct held heap_pop(void) {
    struct held top = S.heap[0], last = S.heap[--S.heap_len];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= S.heap_len) break;
        if (child + 1 < S.heap_len && before(&S.heap[child + 1], &S.heap[child])) child++;
        if (!before(&S.heap[child], &last)) break;
        S.heap[i] = S.heap[child];
        i = child;
    }
    if (S.heap_len) S.heap[i] = last;
    return top;
}

/* accept packet `id` marked for the TEE rule (nfq_set_verdict2 sets the whole mark: nothing else in the
   container's namespace marks packets, so none is lost) */
static int accept_marked(uint32_t id) {
    return nfq_set_verdict2(S.qh, id, NF_ACCEPT, S.dup_mark, 0, NULL);
}

static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa, void *data) {
    (void)msg; (void)data;
    struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
    if (!ph) return 0;
    uint32_t id = ntohl(ph->packet_id);
    S.queued++;
    /* netem_enqueue: the duplicate is drawn first; a loss then takes one copy away */
    uint32_t dup = S.duplicate && S.duplicate >= crandom(&S.dup_cor);
    if (S.ge || S.loss) {
        int lost = S.ge ? ge_lost() : S.loss >= crandom(&S.loss_cor);
        if (lost && dup) { dup = 0; lost = 0; }
        if (lost) {
            S.loss_dropped++;
            if (!S.last_lost) S.loss_bursts++;
        }
        S.last_lost = lost;
        if (lost) return nfq_set_verdict(qh, id, NF_DROP, 0, NULL);
    }
    if (dup) S.duplicated++;
    if (S.gap && reorder_now()) {
        S.reordered++;
        S.accepted++;
        return dup ? accept_marked(id) : nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
    }
    if (S.heap_len >= S.heap_cap) { /* the kernel's queue is as long as ours: only if max_len was raised */
        S.dropped_full++;
        return nfq_set_verdict(qh, id, NF_DROP, 0, NULL);
    }
    int64_t delay = 0;
    for (int i = 0; i < S.draws; i++) delay += tabledist(S.delay_ns, S.jitter_ns);
    if (delay < 0) delay = 0;
    uint64_t arrived = now_ns();
    struct timeval tv;
    if (nfq_get_timestamp(nfa, &tv) == 0) { /* the kernel's arrival stamp: the wall clock */
        struct timespec real;
        clock_gettime(CLOCK_REALTIME, &real);
        int64_t age = ((int64_t)real.tv_sec - (int64_t)tv.tv_sec) * 1000000000ll
                      + ((int64_t)real.tv_nsec - (int64_t)tv.tv_usec * 1000ll);
        if (age >= 0 && age < 1000000000ll && (uint64_t)age < arrived) {
            arrived -= (uint64_t)age;
            S.stamped++;
            S.read_wait_total_ns += (uint64_t)age;
            if ((uint64_t)age > S.read_wait_max_ns) S.read_wait_max_ns = (uint64_t)age;
        }
    }
    heap_push((struct held){arrived + (uint64_t)delay, S.seq++, id, dup});
    if (S.heap_len > S.max_held) S.max_held = S.heap_len;
    return 0;
}

/* accept every held packet due by `now` (all of them when `all`); returns how many */
static size_t release(uint64_t now, int all) {
    size_t n = 0;
    uint32_t last_id = 0;
    int in_order = S.jitter_ns == 0; /* due times follow ids: one batch verdict covers them all */
    while (S.heap_len && (all || S.heap[0].due_ns <= now)) {
        struct held h = heap_pop();
        n++;
        if (!all) {
            int64_t late = (int64_t)(now - h.due_ns);
            S.late_total_ns += late;
            if (late > 0 && (uint64_t)late > S.late_max_ns) S.late_max_ns = (uint64_t)late;
            uint64_t bucket = late > 0 ? (uint64_t)late / LATE_BUCKET_NS : 0;
            S.late_hist[bucket < LATE_BUCKETS ? bucket : LATE_BUCKETS - 1]++;
            if (late < 0 && (uint64_t)-late > S.early_max_ns) S.early_max_ns = (uint64_t)-late;
        }
        if (h.dup) { /* its own verdict, with the mark; the batch so far goes first, to keep the order */
            if (last_id) nfq_set_verdict_batch(S.qh, last_id, NF_ACCEPT);
            last_id = 0;
            accept_marked(h.id);
        } else if (in_order) last_id = h.id;
        else nfq_set_verdict(S.qh, h.id, NF_ACCEPT, 0, NULL);
    }
    if (in_order && last_id) nfq_set_verdict_batch(S.qh, last_id, NF_ACCEPT);
    S.accepted += n;
    return n;
}

/* the lateness below which `pct` % of the accepted packets fall, in ns: its bucket's upper edge, or the
   latest verdict where that is sooner; in the last, open bucket, the latest verdict */
static uint64_t late_percentile_ns(double pct) {
    uint64_t total = 0, seen = 0, edge = (uint64_t)LATE_BUCKETS * LATE_BUCKET_NS;
    for (int i = 0; i < LATE_BUCKETS; i++) total += S.late_hist[i];
    if (!total) return 0;
    for (int i = 0; i < LATE_BUCKETS; i++) {
        seen += S.late_hist[i];
        if ((double)seen >= pct / 100.0 * (double)total) {
            edge = i == LATE_BUCKETS - 1 ? S.late_max_ns : (uint64_t)(i + 1) * LATE_BUCKET_NS;
            break;
        }
    }
    return edge < S.late_max_ns ? edge : S.late_max_ns;
}

static void kernel_counters(unsigned long long *queue_dropped, unsigned long long *user_dropped) {
    /* /proc/net/netfilter/nfnetlink_queue: queue portid total mode range queue_dropped user_dropped id 1 */
    *queue_dropped = *user_dropped = 0;
    FILE *f = fopen("/proc/net/netfilter/nfnetlink_queue", "r");
    if (!f) return;
    unsigned q, portid, total, mode, range, one; unsigned long long qd, ud, idseq;
    while (fscanf(f, "%u %u %u %u %u %llu %llu %llu %u", &q, &portid, &total, &mode, &range, &qd, &ud, &idseq,
                  &one) == 9) {
        if ((int)q == S.queue) { *queue_dropped = qd; *user_dropped = ud; }
    }
    fclose(f);
}

static void write_stats(int running) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    unsigned long long qd, ud;
    kernel_counters(&qd, &ud);
    char tmp[80];
    snprintf(tmp, sizeof tmp, "%s.tmp", STATS_FILE);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "{\"pid\": %d, \"running\": %s, \"realtime\": %s, \"nice\": %d, \"slice_us\": %d, \"queue\": %d, \"delay_us\": %lld, \"jitter_us\": %lld, "
            "\"distribution\": \"%s\", \"draws\": %d, \"max_len_packets\": %d, \"queued_packets\": %llu, "
            "\"accepted_packets\": %llu, \"held_packets\": %zu, \"max_held_packets\": %llu, "
            "\"dropped_full_packets\": %llu, \"kernel_queue_dropped_packets\": %llu, "
            "\"kernel_user_dropped_packets\": %llu, \"late_mean_us\": %.1f, \"late_max_us\": %.1f, "
            "\"late_p99_us\": %.1f, \"stamped_packets\": %llu, \"read_wait_mean_us\": %.1f, \"read_wait_max_us\": %.1f, \"early_max_us\": %.1f, \"wake_lead_us\": %.1f, \"cpu_user_s\": %.6f, \"cpu_system_s\": %.6f, "
            "\"reorder_pct\": %.6f, \"reorder_corr_pct\": %.6f, \"gap\": %u, \"reordered_packets\": %llu, "
            "\"gemodel\": %s, \"ge_p_pct\": %.6f, \"ge_r_pct\": %.6f, \"ge_1h_pct\": %.6f, \"ge_1k_pct\": %.6f, "
            "\"loss_pct\": %.6f, \"loss_corr_pct\": %.6f, \"duplicate_pct\": %.6f, \"duplicate_corr_pct\": %.6f, "
            "\"duplicated_packets\": %llu, "
            "\"loss_dropped_packets\": %llu, \"loss_bursts\": %llu, \"ge_bad_entries\": %llu}\n",
            (int)getpid(), running ? "true" : "false", S.realtime ? "true" : "false", S.nice, S.slice_us, S.queue, (long long)(S.delay_ns / 1000),
            (long long)(S.jitter_ns / 1000), S.distribution ? S.distribution : "uniform", S.draws, S.max_len,
            (unsigned long long)S.queued, (unsigned long long)S.accepted, S.heap_len,
            (unsigned long long)S.max_held, (unsigned long long)S.dropped_full, qd, ud,
            S.accepted ? (double)S.late_total_ns / 1e3 / (double)S.accepted : 0.0, S.late_max_ns / 1e3,
            late_percentile_ns(99.0) / 1e3, (unsigned long long)S.stamped,
            S.stamped ? (double)S.read_wait_total_ns / 1e3 / (double)S.stamped : 0.0, S.read_wait_max_ns / 1e3,
            S.early_max_ns / 1e3, S.wake_lead_ns / 1e3,
            ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6, ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6,
            S.reorder_pct, S.reorder_corr_pct, S.gap, (unsigned long long)S.reordered, S.ge ? "true" : "false",
            S.ge_pct[0], S.ge_pct[1], S.ge_pct[2], S.ge_pct[3], S.loss_pct, S.loss_corr_pct,
            S.duplicate_pct, S.duplicate_corr_pct, (unsigned long long)S.duplicated,
            (unsigned long long)S.loss_dropped,
            (unsigned long long)S.loss_bursts, (unsigned long long)S.ge_bad_entries);
    fclose(f);
    rename(tmp, STATS_FILE);
}

static void fail_start(const char *what) {
    FILE *f = fopen(ERROR_FILE, "w");
    if (f) { fprintf(f, "%s\n", what); fclose(f); }
    fprintf(stderr, "wiiide-delayline: %s\n", what);
    exit(1);
}

static void on_signal(int sig) { (void)sig; S.stop = 1; }

/* bind queue S.queue; returns the handle, or NULL with `err` filled */
static struct nfq_handle *bind_queue(char *err, size_t errlen) {
    struct nfq_handle *h = nfq_open();
    if (!h) { snprintf(err, errlen, "nfq_open: %s (no nfnetlink_queue in this kernel?)", strerror(errno)); return NULL; }
    nfq_unbind_pf(h, AF_INET); /* kernels before 3.8 need the bind; newer ones ignore both */
    nfq_bind_pf(h, AF_INET);
    S.qh = nfq_create_queue(h, (uint16_t)S.queue, on_packet, NULL);
    if (!S.qh) {
        snprintf(err, errlen, "cannot bind queue %d: %s (another consumer bound to it?)", S.queue, strerror(errno));
        nfq_close(h);
        return NULL;
    }
    if (nfq_set_mode(S.qh, NFQNL_COPY_META, 0) < 0) {
        snprintf(err, errlen, "queue %d: cannot set copy mode: %s", S.queue, strerror(errno));
        nfq_destroy_queue(S.qh); nfq_close(h);
        return NULL;
    }
    if (nfq_set_queue_maxlen(S.qh, (uint32_t)S.max_len) < 0) {
        snprintf(err, errlen, "queue %d: cannot set its length to %d: %s", S.queue, S.max_len, strerror(errno));
        nfq_destroy_queue(S.qh); nfq_close(h);
        return NULL;
    }
    /* GSO packets whole; a kernel without the flag answers EOPNOTSUPP: then they come segmented */
    nfq_set_queue_flags(S.qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO);
    int fd = nfq_fd(h), size = RCVBUF_BYTES, one = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, sizeof size) < 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    return h;
}

static int read_pid(void) {
    FILE *f = fopen(PID_FILE, "r");
    int pid = 0;
    if (f) { if (fscanf(f, "%d", &pid) != 1) pid = 0; fclose(f); }
    return pid;
}

static int alive(int pid) { /* running, not a zombie */
    char path[64], state = 0;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int n = fscanf(f, "%*d %*s %c", &state);
    fclose(f);
    return n == 1 && state != 'Z' && state != 'X';
}

static int stop_running(void) {
    unlink(ERROR_FILE); /* a failed start's message must not answer the next start's --wait-ready */
    int pid = read_pid();
    if (pid <= 0 || !alive(pid)) { unlink(PID_FILE); return 0; }
    kill(pid, SIGTERM);
    for (int i = 0; i < 500 && alive(pid); i++) usleep(10000);
    if (alive(pid)) { kill(pid, SIGKILL); for (int i = 0; i < 100 && alive(pid); i++) usleep(10000); }
    unlink(PID_FILE);
    if (alive(pid)) { fprintf(stderr, "wiiide-delayline: pid %d did not stop\n", pid); return 1; }
    return 0;
}

static int wait_ready(double timeout_s) {
    uint64_t until = now_ns() + (uint64_t)(timeout_s * 1e9);
    do {
        FILE *e = fopen(ERROR_FILE, "r");
        if (e) {
            char line[512] = "";
            if (!fgets(line, sizeof line, e)) strcpy(line, "failed to start\n");
            fclose(e);
            fprintf(stderr, "wiiide-delayline: %s", line);
            return 1;
        }
        int pid = read_pid();
        struct stat st;
        if (pid > 0 && alive(pid) && stat(STATS_FILE, &st) == 0) return 0;
        usleep(10000);
    } while (now_ns() < until);
    fprintf(stderr, "wiiide-delayline: not bound after %.1f s\n", timeout_s);
    return 1;
}

/* EEVDF (Linux 6.12+): a fair task's own slice, sched_attr.sched_runtime; a short one gives the task an
   early virtual deadline, so it runs soon after it wakes (PREEMPT_SHORT) without real-time rights */
struct sched_attr_v0 { uint32_t size, policy; uint64_t flags; int32_t nice; uint32_t priority;
                       uint64_t runtime, deadline, period; };

static int short_slice(unsigned us) {
#ifdef SYS_sched_setattr
    struct sched_attr_v0 attr = {.size = sizeof attr, .policy = SCHED_OTHER,
                                 .nice = getpriority(PRIO_PROCESS, 0), .runtime = (uint64_t)us * 1000};
    return syscall(SYS_sched_setattr, 0, &attr, 0) == 0;
#else
    (void)us;
    return 0;
#endif
}

static void usage(void) {
    fprintf(stderr, "usage: wiiide-delayline --queue N --delay-us D [--jitter-us J] [--distribution "
                    "uniform|normal|pareto|paretonormal] [--draws K] [--max-len P]\n"
                    "         [--reorder-pct P [--reorder-corr-pct C] [--gap G]]\n"
                    "         [--ge-p-pct p --ge-r-pct r --ge-1h-pct 1-h --ge-1k-pct 1-k | --loss-pct P [--loss-corr-pct C]]\n"
                    "         [--duplicate-pct P [--duplicate-corr-pct C] --dup-mark M]\n"
                    "       wiiide-delayline [--queue N] --wait-ready [--timeout-s S] | --stop | --check\n");
    exit(2);
}

static long long number(const char *s, const char *what, long long lo, long long hi) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || end == s || v < lo || v > hi) {
        fprintf(stderr, "wiiide-delayline: %s must be a whole number in %lld..%lld, got %s\n", what, lo, hi, s);
        exit(2);
    }
    return v;
}

static double pct(const char *s, const char *what) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || end == s || !(v >= 0.0 && v <= 100.0)) {
        fprintf(stderr, "wiiide-delayline: %s must be a percentage in 0..100, got %s\n", what, s);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv) {
    int check = 0, stop = 0, wait = 0, ge_given = 0, reorder_given = 0, gap_given = 0, loss_given = 0, loss_corr_given = 0, dup_given = 0;
    double timeout_s = 5.0;
    S.queue = 0; S.draws = 1; S.max_len = 1000;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--stop")) { stop = 1; continue; }
        if (!strcmp(a, "--check")) { check = 1; continue; }
        if (!strcmp(a, "--wait-ready")) { wait = 1; continue; }
        if (!v) usage();
        if (!strcmp(a, "--queue")) S.queue = (int)number(v, "--queue", 0, 65535);
        else if (!strcmp(a, "--timeout-s")) timeout_s = atof(v);
        else if (!strcmp(a, "--reorder-pct")) { S.reorder_pct = pct(v, a); reorder_given = 1; }
        else if (!strcmp(a, "--reorder-corr-pct")) S.reorder_corr_pct = pct(v, a);
        else if (!strcmp(a, "--gap")) { S.gap = (uint32_t)number(v, "--gap", 1, 1 << 30); gap_given = 1; }
        else if (!strcmp(a, "--duplicate-pct")) { S.duplicate_pct = pct(v, a); dup_given |= 1; }
        else if (!strcmp(a, "--duplicate-corr-pct")) { S.duplicate_corr_pct = pct(v, a); dup_given |= 2; }
        else if (!strcmp(a, "--dup-mark")) { S.dup_mark = (uint32_t)number(v, "--dup-mark", 1, 0x7fffffff); dup_given |= 4; }
        else if (!strcmp(a, "--loss-pct")) { S.loss_pct = pct(v, a); loss_given = 1; }
        else if (!strcmp(a, "--loss-corr-pct")) { S.loss_corr_pct = pct(v, a); loss_corr_given = 1; }
        else if (!strcmp(a, "--ge-p-pct")) { S.ge_pct[0] = pct(v, a); ge_given |= 1; }
        else if (!strcmp(a, "--ge-r-pct")) { S.ge_pct[1] = pct(v, a); ge_given |= 2; }
        else if (!strcmp(a, "--ge-1h-pct")) { S.ge_pct[2] = pct(v, a); ge_given |= 4; }
        else if (!strcmp(a, "--ge-1k-pct")) { S.ge_pct[3] = pct(v, a); ge_given |= 8; }
        else if (!strcmp(a, "--delay-us")) S.delay_ns = number(v, "--delay-us", 0, 60000000) * 1000;
        else if (!strcmp(a, "--jitter-us")) S.jitter_ns = number(v, "--jitter-us", 0, 60000000) * 1000;
        else if (!strcmp(a, "--draws")) S.draws = (int)number(v, "--draws", 1, 16);
        else if (!strcmp(a, "--max-len")) S.max_len = (int)number(v, "--max-len", 1, 1 << 20);
        else if (!strcmp(a, "--distribution")) S.distribution = v;
        else usage();
        i++;
    }
    if (S.queue != 0) {
        snprintf(PID_FILE, sizeof PID_FILE, "/tmp/wiiide-delayline-%d.pid", S.queue);
        snprintf(STATS_FILE, sizeof STATS_FILE, "/tmp/wiiide-delayline-%d.json", S.queue);
        snprintf(ERROR_FILE, sizeof ERROR_FILE, "/tmp/wiiide-delayline-%d.err", S.queue);
    }
    if (stop) return stop_running();
    if (wait) return wait_ready(timeout_s > 0 ? timeout_s : 5.0);
    if (ge_given && ge_given != 15) {
        fprintf(stderr, "wiiide-delayline: the Gilbert-Elliott loss takes all four of --ge-p-pct, --ge-r-pct, "
                        "--ge-1h-pct and --ge-1k-pct\n");
        return 2;
    }
    if (loss_given && ge_given) {
        fprintf(stderr, "wiiide-delayline: one loss model: --loss-pct (random) or the Gilbert-Elliott chain, not both\n");
        return 2;
    }
    if (loss_corr_given && !loss_given) {
        fprintf(stderr, "wiiide-delayline: --loss-corr-pct needs --loss-pct\n");
        return 2;
    }
    if (dup_given && !((dup_given & 1) && (dup_given & 4))) {
        fprintf(stderr, "wiiide-delayline: a duplicate takes --duplicate-pct and --dup-mark (--duplicate-corr-pct "
                        "optional)\n");
        return 2;
    }
    if (gap_given && !reorder_given) {
        fprintf(stderr, "wiiide-delayline: --gap needs --reorder-pct\n");
        return 2;
    }
    S.ge = ge_given == 15;
    S.ge_p = pct_u32(S.ge_pct[0]); S.ge_r = pct_u32(S.ge_pct[1]);
    S.ge_1h = pct_u32(S.ge_pct[2]); S.ge_1k = pct_u32(S.ge_pct[3]);
    S.reorder = pct_u32(S.reorder_pct);
    S.reorder_cor.rho = pct_u32(S.reorder_corr_pct);
    S.loss = pct_u32(S.loss_pct);
    S.loss_cor.rho = pct_u32(S.loss_corr_pct);
    S.duplicate = pct_u32(S.duplicate_pct);
    S.dup_cor.rho = pct_u32(S.duplicate_corr_pct);
    if (reorder_given && !gap_given) S.gap = 1; /* iproute2: reorder without gap is gap 1 */
    char err[512];
    if (check) {
        struct nfq_handle *h = bind_queue(err, sizeof err);
        if (!h) { fprintf(stderr, "wiiide-delayline: %s\n", err); return 1; }
        nfq_destroy_queue(S.qh);
        nfq_close(h);
        return 0;
    }
    unlink(ERROR_FILE);
    unlink(STATS_FILE);
    int other = read_pid();
    if (other > 0 && other != getpid() && alive(other)) {
        snprintf(err, sizeof err, "already running (pid %d): stop it first (--stop)", other);
        fail_start(err);
    }
    if (S.distribution && strcmp(S.distribution, "uniform") && strcmp(S.distribution, "normal")
        && strcmp(S.distribution, "pareto") && strcmp(S.distribution, "paretonormal"))
        fail_start("--distribution must be uniform, normal, pareto or paretonormal");
    if (load_table(S.distribution, err, sizeof err) < 0) fail_start(err);
    S.heap_cap = (size_t)S.max_len + 64;
    S.heap = calloc(S.heap_cap, sizeof *S.heap);
    if (!S.heap) fail_start("out of memory for the held packets");
    S.rng = now_ns() ^ ((uint64_t)getpid() << 32) ^ 0x9e3779b97f4a7c15ull;
    if (!S.rng) S.rng = 1;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0); /* wake-ups within a microsecond of the due time, not 50 us */
    /* wake-ups on time on a busy machine: real-time priority where the container may have it (CAP_SYS_NICE),
       else the nicest value it may take; the stats say which */
    struct sched_param sp = {.sched_priority = 10};
    S.realtime = sched_setscheduler(0, SCHED_FIFO, &sp) == 0;
    if (!S.realtime) {
        setpriority(PRIO_PROCESS, 0, -10);
        S.slice_us = short_slice(SLICE_US) ? SLICE_US : 0;
    }
    S.nice = getpriority(PRIO_PROCESS, 0);
    struct nfq_handle *h = bind_queue(err, sizeof err);
    if (!h) fail_start(err);
    /* arrival stamps on: the kernel timestamps packets while any socket asks for it (net_enable_timestamp);
       this one is held for the process's life and never read */
    int stamp_fd = socket(AF_INET, SOCK_DGRAM, 0), one = 1;
    if (stamp_fd >= 0) setsockopt(stamp_fd, SOL_SOCKET, SO_TIMESTAMP, &one, sizeof one);
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    FILE *pf = fopen(PID_FILE, "w");
    if (!pf) fail_start("cannot write the pid file");
    fprintf(pf, "%d\n", (int)getpid());
    fclose(pf);
    write_stats(1);

    int fd = nfq_fd(h);
    static char buf[65536] __attribute__((aligned));
    uint64_t next_stats = now_ns() + STATS_EVERY_NS;
    /* A timed wake-up comes late by the scheduler's wake-up latency (a VM's idle exit, the timer
       slack, the run queue): 0.1-0.2 ms on a quiet machine here, more under load. The loop learns that
       lateness (an EWMA, 1/8 per sample, of each long sleep's overshoot, capped at WAKE_LEAD_MAX_NS) and
       ends a long sleep that much before the next due time; a short second sleep (no lead, not learnt
       from: the CPU is not back in deep idle yet) then ends at the due time. A packet is never accepted
       before its due time, as netem's never leaves early; it is accepted later by less than a single
       long sleep would make it (stats: late_mean_us, late_max_us, early_max_us 0, wake_lead_us). It
       costs one more wake-up per due packet after a long wait, and no spinning. */
    while (!S.stop) {
        uint64_t now = now_ns();
        release(now, 0);
        if (now >= next_stats) { write_stats(1); next_stats = now + STATS_EVERY_NS; }
        uint64_t wake = next_stats;
        int long_sleep = 0;
        if (S.heap_len && S.heap[0].due_ns < wake) {
            wake = S.heap[0].due_ns;
            if (wake > now + 2 * (uint64_t)S.wake_lead_ns + WAKE_LONG_NS) { /* a long sleep: end it early */
                wake -= (uint64_t)S.wake_lead_ns;
                long_sleep = 1;
            }
        }
        now = now_ns();
        struct timespec ts = {0, 0};
        if (wake > now) { ts.tv_sec = (time_t)((wake - now) / 1000000000ull); ts.tv_nsec = (long)((wake - now) % 1000000000ull); }
        else long_sleep = 0; /* no sleep asked: nothing to learn from */
        struct pollfd p = {fd, POLLIN, 0};
        int ready = ppoll(&p, 1, &ts, NULL);
        if (ready < 0 && errno != EINTR) break;
        if (ready == 0 && long_sleep) {
            int64_t over = (int64_t)(now_ns() - wake);
            if (over < 0) over = 0;
            if (over > WAKE_LEAD_MAX_NS) over = WAKE_LEAD_MAX_NS;
            S.wake_lead_ns += (over - S.wake_lead_ns) / 8;
        }
        if (ready <= 0) continue;
        for (int m = 0; m < MAX_MSGS_PER_ROUND; m++) {
            ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
            if (n < 0) {
                if (errno == ENOBUFS) continue; /* the kernel could not deliver some: it counted them */
                break;
            }
            nfq_handle_packet(h, buf, (int)n);
        }
    }
    release(0, 1); /* what is still held goes now rather than being dropped on unbind */
    if (stamp_fd >= 0) close(stamp_fd);
    nfq_destroy_queue(S.qh);
    nfq_close(h);
    write_stats(0);
    unlink(PID_FILE);
    return 0;
}
