/* MPI checks for strait's libfabric provider (compiled by tests/libfabric.rs with
 * mpicc). Every payload is checked; the first failure aborts with a message.
 * Usage: mpi_check [all|pingpong|bench] [iterations] */
#include <mpi.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, size;

#define CHECK(c, ...)                                                  \
	do {                                                           \
		if (!(c)) {                                            \
			fprintf(stderr, "rank %d: FAILED %s:%d: ", rank, __FILE__, __LINE__); \
			fprintf(stderr, __VA_ARGS__);                  \
			fprintf(stderr, "\n");                         \
			MPI_Abort(MPI_COMM_WORLD, 2);                  \
		}                                                      \
	} while (0)

static unsigned char pat(size_t i, int seed) { return (unsigned char)((i * 131u + (unsigned)seed * 7u + (i >> 8)) & 0xff); }

static void fill(unsigned char *b, size_t n, int seed)
{
	for (size_t i = 0; i < n; i++)
		b[i] = pat(i, seed);
}
static void verify(const unsigned char *b, size_t n, int seed, const char *what)
{
	for (size_t i = 0; i < n; i++)
		CHECK(b[i] == pat(i, seed), "%s: byte %zu of %zu is %u, expected %u", what, i, n, b[i], pat(i, seed));
}

static void pingpong(void)
{
	static const size_t sizes[] = { 0, 1, 7, 8, 63, 64, 1000, 4095, 4096, 4097, 65535, 65536, 200000,
					262144, 1 << 20, (1 << 20) + 3, 4 << 20 };
	size_t max = 4 << 20;
	unsigned char *b = malloc(max);
	CHECK(b, "malloc");
	if (rank < 2) {
		int peer = 1 - rank;
		for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
			size_t n = sizes[k];
			for (int it = 0; it < 3; it++) {
				int seed = (int)k * 10 + it;
				if (rank == 0) {
					fill(b, n, seed);
					MPI_Send(b, (int)n, MPI_BYTE, peer, 100 + (int)k, MPI_COMM_WORLD);
					memset(b, 0, n);
					MPI_Status st;
					MPI_Recv(b, (int)n, MPI_BYTE, peer, 200 + (int)k, MPI_COMM_WORLD, &st);
					int cnt;
					MPI_Get_count(&st, MPI_BYTE, &cnt);
					CHECK((size_t)cnt == n, "pong count %d != %zu", cnt, n);
					verify(b, n, seed + 1, "pong");
				} else {
					MPI_Status st;
					memset(b, 0, n);
					MPI_Recv(b, (int)n, MPI_BYTE, peer, 100 + (int)k, MPI_COMM_WORLD, &st);
					verify(b, n, seed, "ping");
					fill(b, n, seed + 1);
					MPI_Send(b, (int)n, MPI_BYTE, peer, 200 + (int)k, MPI_COMM_WORLD);
				}
			}
		}
	}
	free(b);
	MPI_Barrier(MPI_COMM_WORLD);
	if (rank == 0)
		printf("pingpong ok\n");
}

static void probes_and_wildcards(void)
{
	/* Every rank sends one tagged message to rank 0; rank 0 probes, then receives
	 * with ANY_SOURCE/ANY_TAG using the probed size. */
	int tag = 1000 + rank;
	size_t n = 1000 + (size_t)rank * 5000;
	unsigned char *b = malloc(200000);
	CHECK(b, "malloc");
	if (rank != 0) {
		fill(b, n, rank);
		MPI_Send(b, (int)n, MPI_BYTE, 0, tag, MPI_COMM_WORLD);
	} else {
		for (int got = 1; got < size; got++) {
			int flag = 0;
			MPI_Status st;
			long spins = 0;
			while (!flag) {
				MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, &st);
				spins++;
			}
			int cnt;
			MPI_Get_count(&st, MPI_BYTE, &cnt);
			CHECK(st.MPI_TAG == 1000 + st.MPI_SOURCE, "iprobe tag %d from %d", st.MPI_TAG, st.MPI_SOURCE);
			CHECK((size_t)cnt == 1000 + (size_t)st.MPI_SOURCE * 5000, "iprobe count %d", cnt);
			MPI_Status st2;
			MPI_Probe(st.MPI_SOURCE, st.MPI_TAG, MPI_COMM_WORLD, &st2);
			CHECK(st2.MPI_SOURCE == st.MPI_SOURCE && st2.MPI_TAG == st.MPI_TAG, "probe disagrees");
			MPI_Recv(b, cnt, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &st2);
			CHECK(st2.MPI_SOURCE == st.MPI_SOURCE, "any-source recv got %d after probing %d", st2.MPI_SOURCE,
			      st.MPI_SOURCE);
			verify(b, (size_t)cnt, st2.MPI_SOURCE, "any-source");
		}
		/* Nothing else is pending now. */
		int flag = 1;
		MPI_Status st;
		MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, &st);
		CHECK(!flag, "iprobe found a message that was never sent");
	}
	free(b);
	MPI_Barrier(MPI_COMM_WORLD);
	if (rank == 0)
		printf("probe/any ok\n");
}

static void cancel_recv(void)
{
	int x = 0;
	MPI_Request r;
	MPI_Irecv(&x, 1, MPI_INT, MPI_ANY_SOURCE, 4242, MPI_COMM_WORLD, &r);
	MPI_Cancel(&r);
	MPI_Status st;
	MPI_Wait(&r, &st);
	int cancelled = 0;
	MPI_Test_cancelled(&st, &cancelled);
	CHECK(cancelled, "receive was not cancelled");
	MPI_Barrier(MPI_COMM_WORLD);
	if (rank == 0)
		printf("cancel ok\n");
}

static void nonblocking(void)
{
	/* Everyone exchanges with everyone, all posted at once, then Waitall. */
	size_t n = 100000;
	unsigned char *sb = malloc(n * (size_t)size), *rb = malloc(n * (size_t)size);
	MPI_Request *rq = malloc(sizeof(MPI_Request) * 2 * (size_t)size);
	CHECK(sb && rb && rq, "malloc");
	int k = 0;
	for (int p = 0; p < size; p++)
		MPI_Irecv(rb + (size_t)p * n, (int)n, MPI_BYTE, p, 7, MPI_COMM_WORLD, &rq[k++]);
	for (int p = 0; p < size; p++) {
		fill(sb + (size_t)p * n, n, rank * 100 + p);
		MPI_Isend(sb + (size_t)p * n, (int)n, MPI_BYTE, p, 7, MPI_COMM_WORLD, &rq[k++]);
	}
	MPI_Waitall(k, rq, MPI_STATUSES_IGNORE);
	for (int p = 0; p < size; p++)
		verify(rb + (size_t)p * n, n, p * 100 + rank, "waitall");
	free(sb);
	free(rb);
	free(rq);
	MPI_Barrier(MPI_COMM_WORLD);
	if (rank == 0)
		printf("nonblocking ok\n");
}

static void collectives(void)
{
	size_t bytes = 16 << 20, n = bytes / sizeof(int64_t);
	int64_t *a = malloc(bytes), *b = malloc(bytes);
	CHECK(a && b, "malloc");
	for (size_t i = 0; i < n; i++)
		a[i] = (int64_t)i * (rank + 1);
	MPI_Allreduce(a, b, (int)n, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
	int64_t f = (int64_t)size * (size + 1) / 2;
	for (size_t i = 0; i < n; i++)
		CHECK(b[i] == (int64_t)i * f, "allreduce[%zu] = %lld", i, (long long)b[i]);

	/* Alltoall: 16 MiB per rank in total. */
	size_t per = n / (size_t)size;
	for (int p = 0; p < size; p++)
		for (size_t i = 0; i < per; i++)
			a[(size_t)p * per + i] = ((int64_t)rank << 40) | ((int64_t)p << 32) | (int64_t)i;
	MPI_Alltoall(a, (int)per, MPI_INT64_T, b, (int)per, MPI_INT64_T, MPI_COMM_WORLD);
	for (int p = 0; p < size; p++)
		for (size_t i = 0; i < per; i++)
			CHECK(b[(size_t)p * per + i] == (((int64_t)p << 40) | ((int64_t)rank << 32) | (int64_t)i),
			      "alltoall from %d [%zu]", p, i);

	unsigned char *c = (unsigned char *)a;
	if (rank == 0)
		fill(c, bytes, 99);
	else
		memset(c, 0, bytes);
	MPI_Bcast(c, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
	verify(c, bytes, 99, "bcast");
	free(a);
	free(b);
	MPI_Barrier(MPI_COMM_WORLD);
	if (rank == 0)
		printf("collectives ok\n");
}

/* Latency and bandwidth between ranks 0 and 1 (for scripts/bench-mpi). */
static void bench(int iters)
{
	static const size_t sizes[] = { 8, 1 << 20 };
	unsigned char *b = malloc(1 << 20);
	CHECK(b, "malloc");
	memset(b, 1, 1 << 20);
	for (size_t k = 0; k < 2; k++) {
		size_t n = sizes[k];
		int it = n > 4096 ? iters / 10 + 10 : iters;
		double best = 1e9;
		for (int rep = 0; rep < 5; rep++) {
			MPI_Barrier(MPI_COMM_WORLD);
			double t0 = MPI_Wtime();
			for (int i = 0; i < it; i++) {
				if (rank == 0) {
					MPI_Send(b, (int)n, MPI_BYTE, 1, 1, MPI_COMM_WORLD);
					MPI_Recv(b, (int)n, MPI_BYTE, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				} else if (rank == 1) {
					MPI_Recv(b, (int)n, MPI_BYTE, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
					MPI_Send(b, (int)n, MPI_BYTE, 0, 1, MPI_COMM_WORLD);
				}
			}
			double t = (MPI_Wtime() - t0) / it / 2;
			if (t < best)
				best = t;
		}
		if (rank == 0)
			printf("bench size %zu one-way %.3f us %.2f GB/s\n", n, best * 1e6, (double)n / best / 1e9);
	}
	free(b);
}

/* MPI_THREAD_MULTIPLE: 4 threads per rank, each a ping-pong with the same thread
 * of the other rank on its own tag, every payload checked. */
#define NTHREADS 4
static void *thread_pingpong(void *arg)
{
	int t = (int)(intptr_t)arg, peer = 1 - rank;
	unsigned char b[3000];
	for (int i = 0; i < 300; i++) {
		size_t n = (size_t)(i * 37 + t * 101) % sizeof(b);
		int seed = t * 1000 + i;
		if (rank == 0) {
			fill(b, n, seed);
			MPI_Send(b, (int)n, MPI_BYTE, peer, 50 + t, MPI_COMM_WORLD);
			MPI_Recv(b, (int)sizeof(b), MPI_BYTE, peer, 50 + t, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			verify(b, n, seed + 1, "thread pong");
		} else {
			MPI_Recv(b, (int)sizeof(b), MPI_BYTE, peer, 50 + t, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			verify(b, n, seed, "thread ping");
			fill(b, n, seed + 1);
			MPI_Send(b, (int)n, MPI_BYTE, peer, 50 + t, MPI_COMM_WORLD);
		}
	}
	return NULL;
}

static void threads(void)
{
	pthread_t th[NTHREADS];
	if (rank < 2) {
		for (int t = 0; t < NTHREADS; t++)
			CHECK(pthread_create(&th[t], NULL, thread_pingpong, (void *)(intptr_t)t) == 0, "pthread_create");
		for (int t = 0; t < NTHREADS; t++)
			pthread_join(th[t], NULL);
	}
	MPI_Barrier(MPI_COMM_WORLD);
	if (rank == 0)
		printf("threads ok\n");
}

int main(int argc, char **argv)
{
	const char *mode = argc > 1 ? argv[1] : "all";
	if (!strcmp(mode, "threads")) {
		int provided;
		MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
		MPI_Comm_rank(MPI_COMM_WORLD, &rank);
		MPI_Comm_size(MPI_COMM_WORLD, &size);
		CHECK(provided == MPI_THREAD_MULTIPLE, "MPI_THREAD_MULTIPLE not provided (%d)", provided);
		threads();
		if (rank == 0)
			printf("all ok\n");
		MPI_Finalize();
		return 0;
	}
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	const char *what = argc > 1 ? argv[1] : "all";
	if (!strcmp(what, "bench")) {
		bench(argc > 2 ? atoi(argv[2]) : 20000);
	} else if (!strcmp(what, "hang")) {
		/* For the rank-kill test: ranks exchange forever until one dies. */
		for (;;) {
			int x = rank;
			MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
		}
	} else {
		pingpong();
		probes_and_wildcards();
		cancel_recv();
		nonblocking();
		if (!strcmp(what, "all"))
			collectives();
	}
	if (rank == 0)
		printf("all ok\n");
	MPI_Finalize();
	return 0;
}
