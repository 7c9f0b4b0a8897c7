/*
 * The C half of strait's libfabric provider: every libfabric structure, function
 * table and attribute lives here, written against the installed headers (so the
 * layouts are the headers' own, not hand copies). Everything with state (addresses,
 * connections, matching, completion queues) is in Rust, behind the small `sfi_*`
 * interface declared below; this file only translates.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <rdma/providers/fi_prov.h>

/* ---- the Rust side (src/ffi.rs) ---- */

/* One completion, in a format-neutral shape; converted here to the CQ's format. */
struct sfi_comp {
	void *ctx;
	uint64_t flags;
	uint64_t len;
	void *buf;
	uint64_t data;
	uint64_t tag;
	uint64_t olen;
	int32_t err;
	int32_t pad;
};

extern void *sfi_domain_open(void);
extern void sfi_domain_close(void *d);
extern void *sfi_av_open(void *d);
extern void sfi_av_close(void *av);
extern int sfi_av_insert(void *av, const void *addr, size_t count, uint64_t *fi_addr);
extern int sfi_av_remove(void *av, const uint64_t *fi_addr, size_t count);
extern int sfi_av_lookup(void *av, uint64_t fi_addr, void *addr, size_t *addrlen);
extern size_t sfi_addrlen(void);
extern void *sfi_cq_open(void *d);
extern int sfi_cq_close(void *cq);
extern ssize_t sfi_cq_read(void *cq, struct sfi_comp *out, size_t count);
extern ssize_t sfi_cq_readerr(void *cq, struct sfi_comp *out);
extern void *sfi_ep_open(void *d, int directed);
extern int sfi_ep_close(void *ep);
extern int sfi_ep_bind_cq(void *ep, void *cq, uint64_t flags);
extern int sfi_ep_bind_av(void *ep, void *av);
extern int sfi_ep_enable(void *ep);
extern int sfi_ep_getname(void *ep, void *addr, size_t *addrlen);
extern ssize_t sfi_ep_send(void *ep, const void *buf, size_t len, uint64_t dest, uint64_t tag,
			   uint64_t data, uint64_t flags, void *ctx);
extern ssize_t sfi_ep_recv(void *ep, void *buf, size_t len, uint64_t src, uint64_t tag,
			   uint64_t ignore, uint64_t flags, void *ctx);
extern ssize_t sfi_ep_cancel(void *ep, void *ctx);

/* ---- attributes ---- */

#define SFI_NAME "strait"
#define SFI_VERSION FI_VERSION(0, 1)
#define SFI_PRIMARY (FI_MSG | FI_TAGGED | FI_SEND | FI_RECV | FI_DIRECTED_RECV)
#define SFI_SECONDARY (FI_LOCAL_COMM | FI_REMOTE_COMM)
/* What a hint may ask for: the above, and CQ data (advertised by cq_data_size). */
#define SFI_CAPS_OK (SFI_PRIMARY | SFI_SECONDARY | FI_REMOTE_CQ_DATA)
/* Send-after-send per peer; no RMA or atomics, so their orderings hold vacuously. */
#define SFI_ORDER (FI_ORDER_SAS | FI_ORDER_RAR | FI_ORDER_RAW | FI_ORDER_RAS | FI_ORDER_WAR | \
		   FI_ORDER_WAW | FI_ORDER_WAS | FI_ORDER_SAR | FI_ORDER_SAW)
#define SFI_TX_OP_FLAGS (FI_COMPLETION | FI_INJECT_COMPLETE | FI_TRANSMIT_COMPLETE)
#define SFI_RX_OP_FLAGS (FI_COMPLETION)
#define SFI_INJECT_SIZE 4096
#define SFI_QUEUE 4096
#define SFI_MAX_MSG ((size_t)1 << 32)
/* How long an empty CQ is polled before each further poll yields the core. */
#define SFI_SPIN_NS 10000ULL

static struct fi_provider sfi_prov;

static int sfi_err_closed(void) { return -FI_ENOSYS; }

/* Fills a fresh fi_info (calloc'd, so libfabric's fi_freeinfo frees it) from the
 * hints, or returns -FI_ENODATA when a hint asks for something not supported. */
static int sfi_fill_info(const struct fi_info *hints, struct fi_info **out)
{
	uint64_t caps = SFI_PRIMARY | SFI_SECONDARY;
	enum fi_threading threading = FI_THREAD_SAFE;
	enum fi_av_type av_type = FI_AV_UNSPEC;
	uint64_t tx_flags = 0, rx_flags = 0;

	if (hints) {
		if (hints->caps & ~SFI_CAPS_OK)
			return -FI_ENODATA;
		if (hints->caps) {
			caps = hints->caps | SFI_SECONDARY;
			if (!(caps & (FI_MSG | FI_TAGGED)))
				caps |= FI_MSG | FI_TAGGED;
			caps &= ~FI_REMOTE_CQ_DATA;
		}
		if (hints->addr_format != FI_FORMAT_UNSPEC)
			return -FI_ENODATA;
		if (hints->ep_attr) {
			const struct fi_ep_attr *e = hints->ep_attr;
			if (e->type != FI_EP_UNSPEC && e->type != FI_EP_RDM)
				return -FI_ENODATA;
			if (e->protocol != FI_PROTO_UNSPEC)
				return -FI_ENODATA;
			if (e->max_msg_size > SFI_MAX_MSG)
				return -FI_ENODATA;
			if (e->tx_ctx_cnt > 1 || e->rx_ctx_cnt > 1)
				return -FI_ENODATA;
			if (e->msg_prefix_size)
				return -FI_ENODATA;
			if (e->auth_key_size || e->auth_key)
				return -FI_ENODATA;
		}
		if (hints->domain_attr) {
			const struct fi_domain_attr *d = hints->domain_attr;
			if (d->name && strcmp(d->name, SFI_NAME))
				return -FI_ENODATA;
			if (d->control_progress == FI_PROGRESS_AUTO || d->data_progress == FI_PROGRESS_AUTO)
				return -FI_ENODATA;
			if (d->resource_mgmt == FI_RM_DISABLED)
				return -FI_ENODATA;
			if (d->av_type != FI_AV_UNSPEC && d->av_type != FI_AV_MAP && d->av_type != FI_AV_TABLE)
				return -FI_ENODATA;
			if (d->cq_data_size > 8)
				return -FI_ENODATA;
			if (d->caps & ~(SFI_SECONDARY))
				return -FI_ENODATA;
			if (d->threading != FI_THREAD_UNSPEC)
				threading = d->threading;
			av_type = d->av_type;
			if (d->auth_key_size || d->auth_key)
				return -FI_ENODATA;
		}
		if (hints->fabric_attr) {
			const struct fi_fabric_attr *f = hints->fabric_attr;
			if (f->name && strcmp(f->name, SFI_NAME))
				return -FI_ENODATA;
		}
		if (hints->tx_attr) {
			const struct fi_tx_attr *t = hints->tx_attr;
			if (t->msg_order & ~SFI_ORDER)
				return -FI_ENODATA;
			if (t->op_flags & ~SFI_TX_OP_FLAGS)
				return -FI_ENODATA;
			if (t->iov_limit > 1 || t->inject_size > SFI_INJECT_SIZE || t->size > SFI_QUEUE)
				return -FI_ENODATA;
			if (t->caps & ~SFI_CAPS_OK)
				return -FI_ENODATA;
			tx_flags = t->op_flags;
		}
		if (hints->rx_attr) {
			const struct fi_rx_attr *r = hints->rx_attr;
			if (r->msg_order & ~SFI_ORDER)
				return -FI_ENODATA;
			if (r->op_flags & ~SFI_RX_OP_FLAGS)
				return -FI_ENODATA;
			if (r->iov_limit > 1 || r->size > SFI_QUEUE || r->total_buffered_recv)
				return -FI_ENODATA;
			if (r->caps & ~SFI_CAPS_OK)
				return -FI_ENODATA;
			rx_flags = r->op_flags;
		}
	}

	struct fi_info *fi = calloc(1, sizeof(*fi));
	if (!fi)
		return -FI_ENOMEM;
	fi->tx_attr = calloc(1, sizeof(*fi->tx_attr));
	fi->rx_attr = calloc(1, sizeof(*fi->rx_attr));
	fi->ep_attr = calloc(1, sizeof(*fi->ep_attr));
	fi->domain_attr = calloc(1, sizeof(*fi->domain_attr));
	fi->fabric_attr = calloc(1, sizeof(*fi->fabric_attr));
	if (!fi->tx_attr || !fi->rx_attr || !fi->ep_attr || !fi->domain_attr || !fi->fabric_attr)
		goto nomem;
	fi->domain_attr->name = strdup(SFI_NAME);
	fi->fabric_attr->name = strdup(SFI_NAME);
	/* prov_name is libfabric's to set (a layered provider's would be "core;util"). */
	if (!fi->domain_attr->name || !fi->fabric_attr->name)
		goto nomem;

	fi->caps = caps;
	fi->mode = 0;
	fi->addr_format = FI_FORMAT_UNSPEC;

	fi->tx_attr->caps = caps & (FI_MSG | FI_TAGGED | FI_SEND);
	fi->tx_attr->op_flags = tx_flags;
	fi->tx_attr->msg_order = FI_ORDER_SAS;
	fi->tx_attr->comp_order = FI_ORDER_NONE;
	fi->tx_attr->inject_size = SFI_INJECT_SIZE;
	fi->tx_attr->size = SFI_QUEUE;
	fi->tx_attr->iov_limit = 1;
	fi->tx_attr->rma_iov_limit = 0;

	fi->rx_attr->caps = caps & (FI_MSG | FI_TAGGED | FI_RECV | FI_DIRECTED_RECV);
	fi->rx_attr->op_flags = rx_flags;
	fi->rx_attr->msg_order = FI_ORDER_SAS;
	fi->rx_attr->comp_order = FI_ORDER_NONE;
	fi->rx_attr->size = SFI_QUEUE;
	fi->rx_attr->iov_limit = 1;

	fi->ep_attr->type = FI_EP_RDM;
	fi->ep_attr->protocol = FI_PROTO_UNSPEC;
	fi->ep_attr->protocol_version = 1;
	fi->ep_attr->max_msg_size = SFI_MAX_MSG;
	fi->ep_attr->mem_tag_format = 0xAAAAAAAAAAAAAAAAULL; /* FI_TAG_GENERIC: all 64 bits */
	fi->ep_attr->tx_ctx_cnt = 1;
	fi->ep_attr->rx_ctx_cnt = 1;

	fi->domain_attr->threading = threading;
	fi->domain_attr->control_progress = FI_PROGRESS_MANUAL;
	fi->domain_attr->data_progress = FI_PROGRESS_MANUAL;
	fi->domain_attr->resource_mgmt = FI_RM_ENABLED;
	fi->domain_attr->av_type = av_type;
	fi->domain_attr->mr_mode = 0;
	fi->domain_attr->mr_key_size = 0;
	fi->domain_attr->cq_data_size = 8;
	fi->domain_attr->cq_cnt = 256;
	fi->domain_attr->ep_cnt = 256;
	fi->domain_attr->tx_ctx_cnt = 256;
	fi->domain_attr->rx_ctx_cnt = 256;
	fi->domain_attr->max_ep_tx_ctx = 1;
	fi->domain_attr->max_ep_rx_ctx = 1;
	fi->domain_attr->mr_iov_limit = 1;
	fi->domain_attr->mr_cnt = 1 << 20;
	fi->domain_attr->caps = SFI_SECONDARY;

	fi->fabric_attr->prov_version = SFI_VERSION;
	fi->fabric_attr->api_version = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
	*out = fi;
	return 0;
nomem:
	free(fi->domain_attr ? fi->domain_attr->name : NULL);
	if (fi->fabric_attr)
		free(fi->fabric_attr->name);
	free(fi->tx_attr);
	free(fi->rx_attr);
	free(fi->ep_attr);
	free(fi->domain_attr);
	free(fi->fabric_attr);
	free(fi);
	return -FI_ENOMEM;
}

static int sfi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
		       const struct fi_info *hints, struct fi_info **info)
{
	if (version < FI_VERSION(1, 5))
		return -FI_ENODATA;
	/* Addresses are the provider's own (fi_getname); a node or service names
	 * nothing it could bind to. */
	if (node || service)
		return -FI_ENODATA;
	return sfi_fill_info(hints, info);
}

/* ---- fabric ---- */

struct sfi_fabric {
	struct fid_fabric f;
};
struct sfi_domain {
	struct fid_domain d;
	void *rs;
};
struct sfi_eq {
	struct fid_eq eq;
};
struct sfi_mr {
	struct fid_mr mr;
};
struct sfi_av {
	struct fid_av av;
	void *rs;
};
struct sfi_cq {
	struct fid_cq cq;
	void *rs;
	enum fi_cq_format format;
	unsigned idle;
	uint64_t idle_since;
};
struct sfi_ep {
	struct fid_ep ep;
	void *rs;
	uint64_t tx_flags, rx_flags;
};

static int sfi_fabric_close(struct fid *fid)
{
	free(fid);
	return 0;
}

static struct fi_ops sfi_fabric_fi_ops = {
	.size = sizeof(struct fi_ops),
	.close = sfi_fabric_close,
	.bind = (void *)sfi_err_closed,
	.control = (void *)sfi_err_closed,
	.ops_open = (void *)sfi_err_closed,
};

/* EQ: an RDM endpoint raises no connection events; an EQ is accepted (fi_pingpong
 * opens one) and stays empty. */
static int sfi_eq_close(struct fid *fid)
{
	free(fid);
	return 0;
}
static ssize_t sfi_eq_read(struct fid_eq *eq, uint32_t *event, void *buf, size_t len, uint64_t flags)
{
	return -FI_EAGAIN;
}
static ssize_t sfi_eq_readerr(struct fid_eq *eq, struct fi_eq_err_entry *buf, uint64_t flags)
{
	return -FI_EAGAIN;
}
static ssize_t sfi_eq_write(struct fid_eq *eq, uint32_t event, const void *buf, size_t len, uint64_t flags)
{
	return -FI_ENOSYS;
}
static ssize_t sfi_eq_sread(struct fid_eq *eq, uint32_t *event, void *buf, size_t len, int timeout,
			    uint64_t flags)
{
	if (timeout > 0) {
		struct timespec ts = { timeout / 1000, (long)(timeout % 1000) * 1000000L };
		nanosleep(&ts, NULL);
	}
	return -FI_EAGAIN;
}
static const char *sfi_eq_strerror(struct fid_eq *eq, int prov_errno, const void *err_data, char *buf,
				   size_t len)
{
	const char *s = strerror(prov_errno);
	if (buf && len) {
		snprintf(buf, len, "%s", s);
		return buf;
	}
	return s;
}
static struct fi_ops sfi_eq_fi_ops = {
	.size = sizeof(struct fi_ops),
	.close = sfi_eq_close,
	.bind = (void *)sfi_err_closed,
	.control = (void *)sfi_err_closed,
	.ops_open = (void *)sfi_err_closed,
};
static struct fi_ops_eq sfi_eq_ops = {
	.size = sizeof(struct fi_ops_eq),
	.read = sfi_eq_read,
	.readerr = sfi_eq_readerr,
	.write = sfi_eq_write,
	.sread = sfi_eq_sread,
	.strerror = sfi_eq_strerror,
};

static int sfi_eq_open(struct fid_fabric *fabric, struct fi_eq_attr *attr, struct fid_eq **eq, void *context)
{
	struct sfi_eq *e = calloc(1, sizeof(*e));
	if (!e)
		return -FI_ENOMEM;
	e->eq.fid.fclass = FI_CLASS_EQ;
	e->eq.fid.context = context;
	e->eq.fid.ops = &sfi_eq_fi_ops;
	e->eq.ops = &sfi_eq_ops;
	*eq = &e->eq;
	return 0;
}

/* ---- memory registration: nothing to register (mr_mode 0); a descriptor is
 * accepted and ignored ---- */

static int sfi_mr_close(struct fid *fid)
{
	free(fid);
	return 0;
}
static struct fi_ops sfi_mr_fi_ops = {
	.size = sizeof(struct fi_ops),
	.close = sfi_mr_close,
	.bind = (void *)sfi_err_closed,
	.control = (void *)sfi_err_closed,
	.ops_open = (void *)sfi_err_closed,
};
static int sfi_mr_make(void *context, struct fid_mr **mr)
{
	struct sfi_mr *m = calloc(1, sizeof(*m));
	if (!m)
		return -FI_ENOMEM;
	m->mr.fid.fclass = FI_CLASS_MR;
	m->mr.fid.context = context;
	m->mr.fid.ops = &sfi_mr_fi_ops;
	m->mr.mem_desc = NULL;
	m->mr.key = 0;
	*mr = &m->mr;
	return 0;
}
static int sfi_mr_reg(struct fid *fid, const void *buf, size_t len, uint64_t access, uint64_t offset,
		      uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context)
{
	return sfi_mr_make(context, mr);
}
static int sfi_mr_regv(struct fid *fid, const struct iovec *iov, size_t count, uint64_t access,
		       uint64_t offset, uint64_t requested_key, uint64_t flags, struct fid_mr **mr,
		       void *context)
{
	return sfi_mr_make(context, mr);
}
static int sfi_mr_regattr(struct fid *fid, const struct fi_mr_attr *attr, uint64_t flags, struct fid_mr **mr)
{
	if (attr->iface != FI_HMEM_SYSTEM)
		return -FI_ENOSYS;
	return sfi_mr_make(attr->context, mr);
}
static struct fi_ops_mr sfi_mr_ops = {
	.size = sizeof(struct fi_ops_mr),
	.reg = sfi_mr_reg,
	.regv = sfi_mr_regv,
	.regattr = sfi_mr_regattr,
};

/* ---- address vector ---- */

static int sfi_av_close_fid(struct fid *fid)
{
	struct sfi_av *a = (struct sfi_av *)fid;
	sfi_av_close(a->rs);
	free(a);
	return 0;
}
static int sfi_av_insert_op(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr,
			    uint64_t flags, void *context)
{
	struct sfi_av *a = (struct sfi_av *)av;
	if (flags & ~(FI_MORE | FI_SYNC_ERR))
		return -FI_EBADFLAGS;
	if (count && !addr)
		return -FI_EINVAL;
	return sfi_av_insert(a->rs, addr, count, fi_addr);
}
static int sfi_av_insertsvc(struct fid_av *av, const char *node, const char *service, fi_addr_t *fi_addr,
			    uint64_t flags, void *context)
{
	return -FI_ENOSYS;
}
static int sfi_av_insertsym(struct fid_av *av, const char *node, size_t nodecnt, const char *service,
			    size_t svccnt, fi_addr_t *fi_addr, uint64_t flags, void *context)
{
	return -FI_ENOSYS;
}
static int sfi_av_remove_op(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags)
{
	struct sfi_av *a = (struct sfi_av *)av;
	if (count && !fi_addr)
		return -FI_EINVAL;
	return sfi_av_remove(a->rs, fi_addr, count);
}
static int sfi_av_lookup_op(struct fid_av *av, fi_addr_t fi_addr, void *addr, size_t *addrlen)
{
	struct sfi_av *a = (struct sfi_av *)av;
	if (!addrlen)
		return -FI_EINVAL;
	return sfi_av_lookup(a->rs, fi_addr, addr, addrlen);
}
static const char *sfi_av_straddr(struct fid_av *av, const void *addr, char *buf, size_t *len)
{
	size_t n = sfi_addrlen(), need = 2 * n + sizeof("strait://");
	char tmp[2 * 64 + sizeof("strait://")];
	size_t at = (size_t)snprintf(tmp, sizeof(tmp), "strait://");
	for (size_t i = 0; i < n && at + 3 <= sizeof(tmp); i++)
		at += (size_t)snprintf(tmp + at, sizeof(tmp) - at, "%02x", ((const unsigned char *)addr)[i]);
	if (buf && *len)
		snprintf(buf, *len, "%s", tmp);
	*len = need;
	return buf;
}
static struct fi_ops sfi_av_fi_ops = {
	.size = sizeof(struct fi_ops),
	.close = sfi_av_close_fid,
	.bind = (void *)sfi_err_closed,
	.control = (void *)sfi_err_closed,
	.ops_open = (void *)sfi_err_closed,
};
static struct fi_ops_av sfi_av_ops = {
	.size = sizeof(struct fi_ops_av),
	.insert = sfi_av_insert_op,
	.insertsvc = sfi_av_insertsvc,
	.insertsym = sfi_av_insertsym,
	.remove = sfi_av_remove_op,
	.lookup = sfi_av_lookup_op,
	.straddr = sfi_av_straddr,
	.av_set = (void *)sfi_err_closed,
};

static int sfi_av_open_op(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av,
			  void *context)
{
	struct sfi_domain *d = (struct sfi_domain *)domain;
	if (attr) {
		if (attr->type != FI_AV_UNSPEC && attr->type != FI_AV_MAP && attr->type != FI_AV_TABLE)
			return -FI_EINVAL;
		if (attr->name || attr->map_addr)
			return -FI_ENOSYS; /* shared (named) AVs */
		if (attr->flags & (FI_EVENT | FI_READ | FI_SYMMETRIC))
			return -FI_ENOSYS;
		if (attr->type == FI_AV_UNSPEC)
			attr->type = FI_AV_MAP;
	}
	struct sfi_av *a = calloc(1, sizeof(*a));
	if (!a)
		return -FI_ENOMEM;
	a->rs = sfi_av_open(d->rs);
	if (!a->rs) {
		free(a);
		return -FI_ENOMEM;
	}
	a->av.fid.fclass = FI_CLASS_AV;
	a->av.fid.context = context;
	a->av.fid.ops = &sfi_av_fi_ops;
	a->av.ops = &sfi_av_ops;
	*av = &a->av;
	return 0;
}

/* ---- completion queue ---- */

static size_t sfi_cq_entry_size(enum fi_cq_format f)
{
	switch (f) {
	case FI_CQ_FORMAT_CONTEXT:
		return sizeof(struct fi_cq_entry);
	case FI_CQ_FORMAT_MSG:
		return sizeof(struct fi_cq_msg_entry);
	case FI_CQ_FORMAT_DATA:
		return sizeof(struct fi_cq_data_entry);
	case FI_CQ_FORMAT_TAGGED:
		return sizeof(struct fi_cq_tagged_entry);
	default:
		return 0;
	}
}

static void sfi_cq_store(enum fi_cq_format f, void *dst, const struct sfi_comp *c)
{
	switch (f) {
	case FI_CQ_FORMAT_CONTEXT: {
		struct fi_cq_entry *e = dst;
		e->op_context = c->ctx;
		break;
	}
	case FI_CQ_FORMAT_MSG: {
		struct fi_cq_msg_entry *e = dst;
		e->op_context = c->ctx;
		e->flags = c->flags;
		e->len = c->len;
		break;
	}
	case FI_CQ_FORMAT_DATA: {
		struct fi_cq_data_entry *e = dst;
		e->op_context = c->ctx;
		e->flags = c->flags;
		e->len = c->len;
		e->buf = c->buf;
		e->data = c->data;
		break;
	}
	default: {
		struct fi_cq_tagged_entry *e = dst;
		e->op_context = c->ctx;
		e->flags = c->flags;
		e->len = c->len;
		e->buf = c->buf;
		e->data = c->data;
		e->tag = c->tag;
		break;
	}
	}
}

#define SFI_CQ_BATCH 64

static ssize_t sfi_cq_read_op(struct fid_cq *cq, void *buf, size_t count)
{
	struct sfi_cq *q = (struct sfi_cq *)cq;
	struct sfi_comp comps[SFI_CQ_BATCH];
	size_t sz = sfi_cq_entry_size(q->format);
	if (count > SFI_CQ_BATCH)
		count = SFI_CQ_BATCH;
	if (count && !buf)
		return -FI_EINVAL;
	ssize_t n = sfi_cq_read(q->rs, comps, count);
	/* FI_THREAD_SAFE: several threads may read one CQ; the idle clock is a hint,
	 * kept in relaxed atomics. */
	if (n > 0) {
		__atomic_store_n(&q->idle, 0, __ATOMIC_RELAXED);
		for (ssize_t i = 0; i < n; i++)
			sfi_cq_store(q->format, (char *)buf + (size_t)i * sz, &comps[i]);
	} else if (n == -FI_EAGAIN) {
		/* Manual progress is driven by this call: a caller that has polled an
		 * empty queue for SFI_SPIN_NS gives its core away on every further empty
		 * read, so that ranks that outnumber the cores do not starve the peer they
		 * wait for (a count of reads would be a time that depends on the devices:
		 * a pass over udp connections costs system calls). */
		unsigned idle = __atomic_add_fetch(&q->idle, 1, __ATOMIC_RELAXED);
		/* The clock is read on the 1st and then every 8th empty poll only. */
		if (idle == 1 || idle % 8 == 0) {
			struct timespec now;
			clock_gettime(CLOCK_MONOTONIC, &now);
			uint64_t t = (uint64_t)now.tv_sec * 1000000000ULL + (uint64_t)now.tv_nsec;
			if (idle == 1)
				__atomic_store_n(&q->idle_since, t, __ATOMIC_RELAXED);
			else if (t - __atomic_load_n(&q->idle_since, __ATOMIC_RELAXED) >= SFI_SPIN_NS) {
				__atomic_store_n(&q->idle, 7, __ATOMIC_RELAXED); /* yield on every 8th poll now */
				sched_yield();
			}
		}
	}
	return n;
}

static ssize_t sfi_cq_readfrom_op(struct fid_cq *cq, void *buf, size_t count, fi_addr_t *src_addr)
{
	ssize_t n = sfi_cq_read_op(cq, buf, count);
	/* FI_SOURCE is not offered: the source is not available. */
	if (src_addr)
		for (ssize_t i = 0; i < n; i++)
			src_addr[i] = FI_ADDR_NOTAVAIL;
	return n;
}

static ssize_t sfi_cq_readerr_op(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags)
{
	struct sfi_cq *q = (struct sfi_cq *)cq;
	struct sfi_comp c;
	if (!buf)
		return -FI_EINVAL;
	ssize_t n = sfi_cq_readerr(q->rs, &c);
	if (n <= 0)
		return n;
	buf->op_context = c.ctx;
	buf->flags = c.flags;
	buf->len = c.len;
	buf->buf = c.buf;
	buf->data = c.data;
	buf->tag = c.tag;
	buf->olen = c.olen;
	buf->err = c.err;
	buf->prov_errno = c.err;
	buf->err_data = NULL;
	buf->err_data_size = 0;
	return 1;
}

static ssize_t sfi_cq_sreadfrom_op(struct fid_cq *cq, void *buf, size_t count, fi_addr_t *src_addr,
				   const void *cond, int timeout)
{
	struct timespec start, now;
	clock_gettime(CLOCK_MONOTONIC, &start);
	for (unsigned spins = 0;; spins++) {
		ssize_t n = sfi_cq_readfrom_op(cq, buf, count, src_addr);
		if (n != -FI_EAGAIN)
			return n;
		if (timeout >= 0) {
			clock_gettime(CLOCK_MONOTONIC, &now);
			long ms = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
			if (ms >= timeout)
				return -FI_EAGAIN;
		}
		if (spins > 4096) {
			struct timespec ts = { 0, 50000 };
			nanosleep(&ts, NULL);
		}
	}
}

static ssize_t sfi_cq_sread_op(struct fid_cq *cq, void *buf, size_t count, const void *cond, int timeout)
{
	return sfi_cq_sreadfrom_op(cq, buf, count, NULL, cond, timeout);
}

static int sfi_cq_signal(struct fid_cq *cq) { return 0; }

static const char *sfi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf,
				   size_t len)
{
	const char *s = prov_errno == FI_ETRUNC ? "message truncated" : strerror(prov_errno);
	if (buf && len) {
		snprintf(buf, len, "strait: %s", s);
		return buf;
	}
	return s;
}

static int sfi_cq_close_fid(struct fid *fid)
{
	struct sfi_cq *q = (struct sfi_cq *)fid;
	int r = sfi_cq_close(q->rs);
	if (r)
		return r;
	free(q);
	return 0;
}

static struct fi_ops sfi_cq_fi_ops = {
	.size = sizeof(struct fi_ops),
	.close = sfi_cq_close_fid,
	.bind = (void *)sfi_err_closed,
	.control = (void *)sfi_err_closed,
	.ops_open = (void *)sfi_err_closed,
};
static struct fi_ops_cq sfi_cq_ops = {
	.size = sizeof(struct fi_ops_cq),
	.read = sfi_cq_read_op,
	.readfrom = sfi_cq_readfrom_op,
	.readerr = sfi_cq_readerr_op,
	.sread = sfi_cq_sread_op,
	.sreadfrom = sfi_cq_sreadfrom_op,
	.signal = sfi_cq_signal,
	.strerror = sfi_cq_strerror,
};

static int sfi_cq_open_op(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq,
			  void *context)
{
	struct sfi_domain *d = (struct sfi_domain *)domain;
	enum fi_cq_format format = FI_CQ_FORMAT_CONTEXT;
	if (attr) {
		if (attr->format != FI_CQ_FORMAT_UNSPEC)
			format = attr->format;
		if (!sfi_cq_entry_size(format))
			return -FI_ENOSYS;
		/* Waiting is a polling loop that backs off: no wait object to hand out. */
		if (attr->wait_obj != FI_WAIT_NONE && attr->wait_obj != FI_WAIT_UNSPEC &&
		    attr->wait_obj != FI_WAIT_YIELD)
			return -FI_ENOSYS;
		if (attr->wait_cond != FI_CQ_COND_NONE)
			return -FI_ENOSYS;
		if (attr->flags & FI_AFFINITY)
			return -FI_ENOSYS;
		attr->format = format;
	}
	struct sfi_cq *q = calloc(1, sizeof(*q));
	if (!q)
		return -FI_ENOMEM;
	q->rs = sfi_cq_open(d->rs);
	if (!q->rs) {
		free(q);
		return -FI_ENOMEM;
	}
	q->format = format;
	q->cq.fid.fclass = FI_CLASS_CQ;
	q->cq.fid.context = context;
	q->cq.fid.ops = &sfi_cq_fi_ops;
	q->cq.ops = &sfi_cq_ops;
	*cq = &q->cq;
	return 0;
}

/* ---- endpoint ---- */

#define EP(e) (((struct sfi_ep *)(e))->rs)

static int sfi_ep_close_fid(struct fid *fid)
{
	struct sfi_ep *e = (struct sfi_ep *)fid;
	int r = sfi_ep_close(e->rs);
	if (r)
		return r;
	free(e);
	return 0;
}

static int sfi_ep_bind_op(struct fid *fid, struct fid *bfid, uint64_t flags)
{
	struct sfi_ep *e = (struct sfi_ep *)fid;
	switch (bfid->fclass) {
	case FI_CLASS_CQ:
		if (flags & ~(FI_TRANSMIT | FI_RECV | FI_SELECTIVE_COMPLETION))
			return -FI_EBADFLAGS;
		return sfi_ep_bind_cq(e->rs, ((struct sfi_cq *)bfid)->rs, flags);
	case FI_CLASS_AV:
		return sfi_ep_bind_av(e->rs, ((struct sfi_av *)bfid)->rs);
	case FI_CLASS_EQ:
		return 0; /* no events on an RDM endpoint */
	default:
		return -FI_ENOSYS; /* counters, STX/SRX contexts */
	}
}

static int sfi_ep_control(struct fid *fid, int command, void *arg)
{
	struct sfi_ep *e = (struct sfi_ep *)fid;
	switch (command) {
	case FI_ENABLE:
		return sfi_ep_enable(e->rs);
	case FI_GETOPSFLAG: {
		uint64_t *f = arg;
		if (!f)
			return -FI_EINVAL;
		*f = (*f & FI_TRANSMIT) ? e->tx_flags : e->rx_flags;
		return 0;
	}
	case FI_SETOPSFLAG: {
		uint64_t *f = arg;
		if (!f)
			return -FI_EINVAL;
		if (*f & FI_TRANSMIT)
			e->tx_flags = *f & ~(FI_TRANSMIT | FI_RECV);
		else
			e->rx_flags = *f & ~(FI_TRANSMIT | FI_RECV);
		return 0;
	}
	default:
		return -FI_ENOSYS;
	}
}

static struct fi_ops sfi_ep_fi_ops = {
	.size = sizeof(struct fi_ops),
	.close = sfi_ep_close_fid,
	.bind = sfi_ep_bind_op,
	.control = sfi_ep_control,
	.ops_open = (void *)sfi_err_closed,
};

static ssize_t sfi_cancel(fid_t fid, void *context)
{
	return sfi_ep_cancel(EP(fid), context);
}
static int sfi_getopt(fid_t fid, int level, int optname, void *optval, size_t *optlen)
{
	return -FI_ENOPROTOOPT;
}
static int sfi_setopt(fid_t fid, int level, int optname, const void *optval, size_t optlen)
{
	return -FI_ENOPROTOOPT;
}
static ssize_t sfi_rx_size_left(struct fid_ep *ep) { return SFI_QUEUE; }
static ssize_t sfi_tx_size_left(struct fid_ep *ep) { return SFI_QUEUE; }

static struct fi_ops_ep sfi_ep_ops = {
	.size = sizeof(struct fi_ops_ep),
	.cancel = sfi_cancel,
	.getopt = sfi_getopt,
	.setopt = sfi_setopt,
	.tx_ctx = (void *)sfi_err_closed,
	.rx_ctx = (void *)sfi_err_closed,
	.rx_size_left = sfi_rx_size_left,
	.tx_size_left = sfi_tx_size_left,
};

static int sfi_getname(fid_t fid, void *addr, size_t *addrlen)
{
	if (!addrlen)
		return -FI_EINVAL;
	return sfi_ep_getname(EP(fid), addr, addrlen);
}
static int sfi_cm_shutdown(struct fid_ep *ep, uint64_t flags) { return 0; }

static struct fi_ops_cm sfi_cm_ops = {
	.size = sizeof(struct fi_ops_cm),
	.setname = (void *)sfi_err_closed,
	.getname = sfi_getname,
	.getpeer = (void *)sfi_err_closed,
	.connect = (void *)sfi_err_closed,
	.listen = (void *)sfi_err_closed,
	.accept = (void *)sfi_err_closed,
	.reject = (void *)sfi_err_closed,
	.shutdown = sfi_cm_shutdown,
	.join = (void *)sfi_err_closed,
};

/* One buffer from an iovec of at most one element. */
static int sfi_one_iov(const struct iovec *iov, size_t count, void **buf, size_t *len)
{
	if (count > 1)
		return -FI_EINVAL;
	if (count == 0) {
		*buf = NULL;
		*len = 0;
		return 0;
	}
	if (!iov)
		return -FI_EINVAL;
	*buf = iov[0].iov_base;
	*len = iov[0].iov_len;
	return 0;
}

#define SFI_SEND_FLAGS (FI_COMPLETION | FI_INJECT | FI_REMOTE_CQ_DATA | FI_INJECT_COMPLETE | \
			FI_TRANSMIT_COMPLETE | FI_DELIVERY_COMPLETE | FI_MORE | FI_FENCE)
#define SFI_RECV_FLAGS (FI_COMPLETION | FI_MORE)
#define SFI_TRECV_FLAGS (FI_COMPLETION | FI_MORE | FI_PEEK | FI_CLAIM | FI_DISCARD)

/* untagged */
static ssize_t sfi_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, void *ctx)
{
	struct sfi_ep *e = (struct sfi_ep *)ep;
	return sfi_ep_recv(e->rs, buf, len, src, 0, 0, e->rx_flags | FI_MSG, ctx);
}
static ssize_t sfi_recvv(struct fid_ep *ep, const struct iovec *iov, void **desc, size_t count,
			 fi_addr_t src, void *ctx)
{
	void *b;
	size_t l;
	int r = sfi_one_iov(iov, count, &b, &l);
	return r ? r : sfi_recv(ep, b, l, NULL, src, ctx);
}
static ssize_t sfi_recvmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags)
{
	void *b;
	size_t l;
	if (!msg || (flags & ~SFI_RECV_FLAGS))
		return -FI_EBADFLAGS;
	int r = sfi_one_iov(msg->msg_iov, msg->iov_count, &b, &l);
	return r ? r : sfi_ep_recv(EP(ep), b, l, msg->addr, 0, 0, flags | FI_MSG, msg->context);
}
static ssize_t sfi_send(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest, void *ctx)
{
	struct sfi_ep *e = (struct sfi_ep *)ep;
	return sfi_ep_send(e->rs, buf, len, dest, 0, 0, e->tx_flags | FI_MSG, ctx);
}
static ssize_t sfi_sendv(struct fid_ep *ep, const struct iovec *iov, void **desc, size_t count,
			 fi_addr_t dest, void *ctx)
{
	void *b;
	size_t l;
	int r = sfi_one_iov(iov, count, &b, &l);
	return r ? r : sfi_send(ep, b, l, NULL, dest, ctx);
}
static ssize_t sfi_sendmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags)
{
	void *b;
	size_t l;
	if (!msg || (flags & ~SFI_SEND_FLAGS))
		return -FI_EBADFLAGS;
	int r = sfi_one_iov(msg->msg_iov, msg->iov_count, &b, &l);
	return r ? r : sfi_ep_send(EP(ep), b, l, msg->addr, 0, msg->data, flags | FI_MSG, msg->context);
}
static ssize_t sfi_inject(struct fid_ep *ep, const void *buf, size_t len, fi_addr_t dest)
{
	return sfi_ep_send(EP(ep), buf, len, dest, 0, 0, FI_MSG | FI_INJECT, NULL);
}
static ssize_t sfi_senddata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data,
			    fi_addr_t dest, void *ctx)
{
	struct sfi_ep *e = (struct sfi_ep *)ep;
	return sfi_ep_send(e->rs, buf, len, dest, 0, data, e->tx_flags | FI_MSG | FI_REMOTE_CQ_DATA, ctx);
}
static ssize_t sfi_injectdata(struct fid_ep *ep, const void *buf, size_t len, uint64_t data, fi_addr_t dest)
{
	return sfi_ep_send(EP(ep), buf, len, dest, 0, data, FI_MSG | FI_INJECT | FI_REMOTE_CQ_DATA, NULL);
}

static struct fi_ops_msg sfi_msg_ops = {
	.size = sizeof(struct fi_ops_msg),
	.recv = sfi_recv,
	.recvv = sfi_recvv,
	.recvmsg = sfi_recvmsg,
	.send = sfi_send,
	.sendv = sfi_sendv,
	.sendmsg = sfi_sendmsg,
	.inject = sfi_inject,
	.senddata = sfi_senddata,
	.injectdata = sfi_injectdata,
};

/* tagged */
static ssize_t sfi_trecv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t tag,
			 uint64_t ignore, void *ctx)
{
	struct sfi_ep *e = (struct sfi_ep *)ep;
	return sfi_ep_recv(e->rs, buf, len, src, tag, ignore, e->rx_flags | FI_TAGGED, ctx);
}
static ssize_t sfi_trecvv(struct fid_ep *ep, const struct iovec *iov, void **desc, size_t count,
			  fi_addr_t src, uint64_t tag, uint64_t ignore, void *ctx)
{
	void *b;
	size_t l;
	int r = sfi_one_iov(iov, count, &b, &l);
	return r ? r : sfi_trecv(ep, b, l, NULL, src, tag, ignore, ctx);
}
static ssize_t sfi_trecvmsg(struct fid_ep *ep, const struct fi_msg_tagged *msg, uint64_t flags)
{
	void *b;
	size_t l;
	if (!msg || (flags & ~SFI_TRECV_FLAGS))
		return -FI_EBADFLAGS;
	int r = sfi_one_iov(msg->msg_iov, msg->iov_count, &b, &l);
	return r ? r
		 : sfi_ep_recv(EP(ep), b, l, msg->addr, msg->tag, msg->ignore, flags | FI_TAGGED,
			       msg->context);
}
static ssize_t sfi_tsend(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest,
			 uint64_t tag, void *ctx)
{
	struct sfi_ep *e = (struct sfi_ep *)ep;
	return sfi_ep_send(e->rs, buf, len, dest, tag, 0, e->tx_flags | FI_TAGGED, ctx);
}
static ssize_t sfi_tsendv(struct fid_ep *ep, const struct iovec *iov, void **desc, size_t count,
			  fi_addr_t dest, uint64_t tag, void *ctx)
{
	void *b;
	size_t l;
	int r = sfi_one_iov(iov, count, &b, &l);
	return r ? r : sfi_tsend(ep, b, l, NULL, dest, tag, ctx);
}
static ssize_t sfi_tsendmsg(struct fid_ep *ep, const struct fi_msg_tagged *msg, uint64_t flags)
{
	void *b;
	size_t l;
	if (!msg || (flags & ~SFI_SEND_FLAGS))
		return -FI_EBADFLAGS;
	int r = sfi_one_iov(msg->msg_iov, msg->iov_count, &b, &l);
	return r ? r
		 : sfi_ep_send(EP(ep), b, l, msg->addr, msg->tag, msg->data, flags | FI_TAGGED,
			       msg->context);
}
static ssize_t sfi_tinject(struct fid_ep *ep, const void *buf, size_t len, fi_addr_t dest, uint64_t tag)
{
	return sfi_ep_send(EP(ep), buf, len, dest, tag, 0, FI_TAGGED | FI_INJECT, NULL);
}
static ssize_t sfi_tsenddata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data,
			     fi_addr_t dest, uint64_t tag, void *ctx)
{
	struct sfi_ep *e = (struct sfi_ep *)ep;
	return sfi_ep_send(e->rs, buf, len, dest, tag, data, e->tx_flags | FI_TAGGED | FI_REMOTE_CQ_DATA,
			   ctx);
}
static ssize_t sfi_tinjectdata(struct fid_ep *ep, const void *buf, size_t len, uint64_t data,
			       fi_addr_t dest, uint64_t tag)
{
	return sfi_ep_send(EP(ep), buf, len, dest, tag, data, FI_TAGGED | FI_INJECT | FI_REMOTE_CQ_DATA,
			   NULL);
}

static struct fi_ops_tagged sfi_tagged_ops = {
	.size = sizeof(struct fi_ops_tagged),
	.recv = sfi_trecv,
	.recvv = sfi_trecvv,
	.recvmsg = sfi_trecvmsg,
	.send = sfi_tsend,
	.sendv = sfi_tsendv,
	.sendmsg = sfi_tsendmsg,
	.inject = sfi_tinject,
	.senddata = sfi_tsenddata,
	.injectdata = sfi_tinjectdata,
};

static int sfi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context)
{
	struct sfi_domain *d = (struct sfi_domain *)domain;
	if (info && info->ep_attr && info->ep_attr->type != FI_EP_RDM && info->ep_attr->type != FI_EP_UNSPEC)
		return -FI_ENOSYS;
	struct sfi_ep *e = calloc(1, sizeof(*e));
	if (!e)
		return -FI_ENOMEM;
	/* Without FI_DIRECTED_RECV a receive's source address is ignored. */
	int directed = !info || (info->caps & FI_DIRECTED_RECV) || (info->rx_attr && (info->rx_attr->caps & FI_DIRECTED_RECV));
	e->rs = sfi_ep_open(d->rs, directed);
	if (!e->rs) {
		free(e);
		return -FI_ENOMEM;
	}
	if (info && info->tx_attr)
		e->tx_flags = info->tx_attr->op_flags;
	if (info && info->rx_attr)
		e->rx_flags = info->rx_attr->op_flags;
	e->ep.fid.fclass = FI_CLASS_EP;
	e->ep.fid.context = context;
	e->ep.fid.ops = &sfi_ep_fi_ops;
	e->ep.ops = &sfi_ep_ops;
	e->ep.cm = &sfi_cm_ops;
	e->ep.msg = &sfi_msg_ops;
	e->ep.tagged = &sfi_tagged_ops;
	*ep = &e->ep;
	return 0;
}

/* ---- domain ---- */

static int sfi_domain_close_fid(struct fid *fid)
{
	struct sfi_domain *d = (struct sfi_domain *)fid;
	sfi_domain_close(d->rs);
	free(d);
	return 0;
}
static struct fi_ops sfi_domain_fi_ops = {
	.size = sizeof(struct fi_ops),
	.close = sfi_domain_close_fid,
	.bind = (void *)sfi_err_closed,
	.control = (void *)sfi_err_closed,
	.ops_open = (void *)sfi_err_closed,
};
static struct fi_ops_domain sfi_domain_ops = {
	.size = sizeof(struct fi_ops_domain),
	.av_open = sfi_av_open_op,
	.cq_open = sfi_cq_open_op,
	.endpoint = sfi_endpoint,
	.scalable_ep = (void *)sfi_err_closed,
	.cntr_open = (void *)sfi_err_closed,
	.poll_open = (void *)sfi_err_closed,
	.stx_ctx = (void *)sfi_err_closed,
	.srx_ctx = (void *)sfi_err_closed,
	.query_atomic = (void *)sfi_err_closed,
	.query_collective = (void *)sfi_err_closed,
};

static int sfi_domain_op(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **dom,
			 void *context)
{
	if (info && info->domain_attr && info->domain_attr->name && strcmp(info->domain_attr->name, SFI_NAME))
		return -FI_EINVAL;
	struct sfi_domain *d = calloc(1, sizeof(*d));
	if (!d)
		return -FI_ENOMEM;
	d->rs = sfi_domain_open();
	if (!d->rs) {
		free(d);
		return -FI_ENOMEM;
	}
	d->d.fid.fclass = FI_CLASS_DOMAIN;
	d->d.fid.context = context;
	d->d.fid.ops = &sfi_domain_fi_ops;
	d->d.ops = &sfi_domain_ops;
	d->d.mr = &sfi_mr_ops;
	*dom = &d->d;
	return 0;
}

static struct fi_ops_fabric sfi_fabric_ops = {
	.size = sizeof(struct fi_ops_fabric),
	.domain = sfi_domain_op,
	.passive_ep = (void *)sfi_err_closed,
	.eq_open = sfi_eq_open,
	.wait_open = (void *)sfi_err_closed,
	.trywait = (void *)sfi_err_closed,
};

static int sfi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context)
{
	if (attr && attr->name && strcmp(attr->name, SFI_NAME))
		return -FI_ENODATA;
	struct sfi_fabric *f = calloc(1, sizeof(*f));
	if (!f)
		return -FI_ENOMEM;
	f->f.fid.fclass = FI_CLASS_FABRIC;
	f->f.fid.context = context;
	f->f.fid.ops = &sfi_fabric_fi_ops;
	f->f.ops = &sfi_fabric_ops;
	*fabric = &f->f;
	return 0;
}

static void sfi_cleanup(void) {}

static struct fi_provider sfi_prov = {
	.version = SFI_VERSION,
	.fi_version = FI_VERSION(1, 17),
	.name = SFI_NAME,
	.getinfo = sfi_getinfo,
	.fabric = sfi_fabric,
	.cleanup = sfi_cleanup,
};

/* Called by the Rust-exported `fi_prov_ini` (a Rust cdylib exports only Rust
 * symbols). */
struct fi_provider *strait_fi_provider(void)
{
	return &sfi_prov;
}
