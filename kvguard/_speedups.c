/* kvguard._speedups: compiled twins of the transition kernel's hot primitives.
 *
 * An engine's scheduler calls the pool several times per step (vLLM: allocation,
 * prefix hits, frees, the validation pass); in pure Python each call's per-block
 * loop and its layers of calls cost more than vLLM's own pool does for the same
 * blocks. Each method of FastPath here does, for the *common* case, exactly what the
 * Python primitive of kvguard/transition_kernel.py of the same name does -- the same
 * state changes, the same order -- or changes nothing and returns None/False, and the
 * Python path (the reference, which names every error) runs instead.
 *
 * The block records stay Python objects (a slots dataclass, which vLLM reads as its
 * KVCacheBlock): their fields are read and written here through the offsets of their
 * slot descriptors, looked up once; the free queue's and the zero queue's structures
 * are the ones those classes declare for their compiled twins (kvguard/free_queue.py,
 * kvguard/zeroing.py). States are the BlockState members the kernel passes in, read off
 * its one transition table; nothing here decides a transition.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyTypeObject *block_type;
    PyObject *blocks;      /* list of block records, index = block id */
    PyObject *free_queue;  /* kvguard.free_queue.FreeQueue */
    PyObject *empty;       /* its list of FREE block ids */
    PyObject *quarantined; /* its list of QUARANTINED block ids */
    PyObject *index;       /* the prefix index: dict hash -> block id */
    PyObject *st_allocated;
    PyObject *st_written_from_allocated;
    PyObject *st_written;
    PyObject *st_free;
    PyObject *st_validated;            /* WRITTEN --VALIDATE--> */
    PyObject *st_published;            /* VALIDATED --PUBLISH--> */
    PyObject *st_quarantined;          /* WRITTEN --RELEASE--> (and its own RELEASE) */
    PyObject *stays_cached;            /* tuple: states a release leaves cached */
    PyObject *acquirable;              /* tuple: states ACQUIRE leaves as they are */
    PyObject *evict_to;                /* dict: cached state -> its state after EVICT */
    PyObject *counters;                /* kvguard.stats.Counters */
    PyObject *block_removed;           /* kvguard.events.BlockRemoved */
    PyObject *zero_blocks;             /* the zero queue's dict of block ids */
    PyObject *tainted;                 /* the pool's set of tainted hashes */
    PyObject *events;                  /* the event log (a list), or None: not recorded */
    /* The kernel's side tables (dicts keyed by block id; an absent id has none):
     * block-level writers in flight, deferred publications, retention classes != 0. */
    PyObject *writers_map, *pending_map, *retention_map;
    PyObject *zero_int, *one_int;      /* 0 and 1 */
    /* The Python primitives these twins stand for: each twin calls its own when it
     * declines (having changed nothing); release_held hands the blocks it does not
     * settle itself to settle_released, release_table to drop_last_refs. Set by
     * fallbacks(). */
    PyObject *py_allocate, *py_acquire, *py_release_held, *py_validate_held, *settle_released;
    /* release_table's primitive, and the end of it in Python (drop_last_refs). */
    PyObject *py_release_table, *drop_last_refs;
    int zero_all;                      /* zero_policy ALL: every allocation queues zeroing */
    int zero_suspect;                  /* zero_policy SUSPECT: reused quarantined blocks do */
    Py_ssize_t off_block_id, off_state, off_ref_cnt, off_block_hash, off_parent_hash,
        off_generation, off_external_refs, off_size, off_first,
        off_num_evictable, off_evictable, off_blocks_evicted, off_blocks_zeroed, off_blocks_quarantined,
        off_blocks_published, off_deferred_publications;
} FastPath;

#define FIELD(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* The twin declines: the Python primitive of the same name runs, with the same
 * arguments, and its result (or error) is the call's. */
#define DECLINE(primitive) return decline(self->primitive, args, nargs)

static PyObject *
decline(PyObject *primitive, PyObject *const *args, Py_ssize_t nargs)
{
    if (primitive == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvguard: FastPath.fallbacks() was not called");
        return NULL;
    }
    return PyObject_Vectorcall(primitive, args, nargs, NULL);
}

/* Remove `key` from a side table if it is there. */
static int
forget(PyObject *map, PyObject *key)
{
    int has = PyDict_Contains(map, key);
    if (has <= 0)
        return has;
    return PyDict_DelItem(map, key);
}

/* A block's retention class (borrowed): the retention map's, else 0. */
static PyObject *
retention_of(FastPath *self, PyObject *id_obj)
{
    PyObject *retention = PyDict_GetItemWithError(self->retention_map, id_obj);
    if (retention == NULL && !PyErr_Occurred())
        retention = self->zero_int;
    return retention;
}

/* Replace a slot's value (a new reference is taken on v). */
static inline void
set_field(PyObject *obj, Py_ssize_t off, PyObject *v)
{
    PyObject **p = &FIELD(obj, off);
    PyObject *old = *p;
    Py_INCREF(v);
    *p = v;
    Py_XDECREF(old);
}

/* Replace a slot's value with a new reference the caller hands over (v non-NULL). */
static inline void
put_field(PyObject *obj, Py_ssize_t off, PyObject *v)
{
    PyObject **p = &FIELD(obj, off);
    PyObject *old = *p;
    *p = v;
    Py_XDECREF(old);
}

/* A slot holding an exact int that fits a long: 1 and *out set; else 0 (no error set). */
static inline int
get_long(PyObject *obj, Py_ssize_t off, long *out)
{
    PyObject *v = FIELD(obj, off);
    if (v == NULL || !PyLong_CheckExact(v))
        return 0;
    long x = PyLong_AsLong(v);
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = x;
    return 1;
}

static int
add_to_field(PyObject *obj, Py_ssize_t off, long value, long delta)
{
    PyObject *v = PyLong_FromLong(value + delta);
    if (v == NULL)
        return -1;
    put_field(obj, off, v);
    return 0;
}

/* obj.<slot at off> += delta for a slot holding an int (RuntimeError otherwise). */
static int
bump_field(PyObject *obj, Py_ssize_t off, long delta)
{
    long value;
    if (!get_long(obj, off, &value)) {
        PyErr_SetString(PyExc_RuntimeError, "kvguard: a counter is not an int");
        return -1;
    }
    return add_to_field(obj, off, value, delta);
}

/* The block record with this id, or NULL (no error set) when id_obj is not an exact
 * int naming one of the pool's blocks of the expected type. */
static inline PyObject *
block_of(FastPath *self, PyObject *id_obj)
{
    if (!PyLong_CheckExact(id_obj))
        return NULL;
    Py_ssize_t i = PyLong_AsSsize_t(id_obj);
    if (i == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return NULL;
    }
    if (i < 0 || i >= PyList_GET_SIZE(self->blocks))
        return NULL;
    PyObject *block = PyList_GET_ITEM(self->blocks, i);
    if (Py_TYPE(block) != self->block_type)
        return NULL;
    return block;
}

static inline int
in_tuple(PyObject *tuple, PyObject *item)
{
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyTuple_GET_ITEM(tuple, i) == item)
            return 1;
    return 0;
}

static Py_ssize_t
slot_offset(PyObject *type, const char *name)
{
    PyObject *d = PyObject_GetAttrString(type, name);
    if (d == NULL)
        return -1;
    if (!Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "%R.%s is not a slot", type, name);
        Py_DECREF(d);
        return -1;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    Py_ssize_t off = m->offset;
    int ok = m->type == T_OBJECT_EX || m->type == T_OBJECT;
    Py_DECREF(d);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%R.%s is not an object slot", type, name);
        return -1;
    }
    return off;
}

static void
FastPath_dealloc(FastPath *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->block_type);
    Py_CLEAR(self->blocks);
    Py_CLEAR(self->free_queue);
    Py_CLEAR(self->empty);
    Py_CLEAR(self->quarantined);
    Py_CLEAR(self->index);
    Py_CLEAR(self->st_allocated);
    Py_CLEAR(self->st_written_from_allocated);
    Py_CLEAR(self->st_written);
    Py_CLEAR(self->st_free);
    Py_CLEAR(self->st_validated);
    Py_CLEAR(self->st_published);
    Py_CLEAR(self->st_quarantined);
    Py_CLEAR(self->stays_cached);
    Py_CLEAR(self->acquirable);
    Py_CLEAR(self->evict_to);
    Py_CLEAR(self->counters);
    Py_CLEAR(self->block_removed);
    Py_CLEAR(self->zero_blocks);
    Py_CLEAR(self->tainted);
    Py_CLEAR(self->events);
    Py_CLEAR(self->py_allocate);
    Py_CLEAR(self->py_acquire);
    Py_CLEAR(self->py_release_held);
    Py_CLEAR(self->py_validate_held);
    Py_CLEAR(self->settle_released);
    Py_CLEAR(self->py_release_table);
    Py_CLEAR(self->drop_last_refs);
    Py_CLEAR(self->writers_map);
    Py_CLEAR(self->pending_map);
    Py_CLEAR(self->retention_map);
    Py_CLEAR(self->zero_int);
    Py_CLEAR(self->one_int);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
FastPath_traverse(FastPath *self, visitproc visit, void *arg)
{
    Py_VISIT(self->block_type);
    Py_VISIT(self->blocks);
    Py_VISIT(self->free_queue);
    Py_VISIT(self->empty);
    Py_VISIT(self->quarantined);
    Py_VISIT(self->index);
    Py_VISIT(self->stays_cached);
    Py_VISIT(self->acquirable);
    Py_VISIT(self->evict_to);
    Py_VISIT(self->counters);
    Py_VISIT(self->block_removed);
    Py_VISIT(self->zero_blocks);
    Py_VISIT(self->tainted);
    Py_VISIT(self->events);
    Py_VISIT(self->py_allocate);
    Py_VISIT(self->py_acquire);
    Py_VISIT(self->py_release_held);
    Py_VISIT(self->py_validate_held);
    Py_VISIT(self->settle_released);
    Py_VISIT(self->py_release_table);
    Py_VISIT(self->drop_last_refs);
    Py_VISIT(self->writers_map);
    Py_VISIT(self->pending_map);
    Py_VISIT(self->retention_map);
    return 0;
}

static int
FastPath_clear(FastPath *self)
{
    Py_CLEAR(self->blocks);
    Py_CLEAR(self->free_queue);
    Py_CLEAR(self->empty);
    Py_CLEAR(self->quarantined);
    Py_CLEAR(self->index);
    Py_CLEAR(self->counters);
    Py_CLEAR(self->zero_blocks);
    Py_CLEAR(self->tainted);
    Py_CLEAR(self->events);
    Py_CLEAR(self->py_allocate);
    Py_CLEAR(self->py_acquire);
    Py_CLEAR(self->py_release_held);
    Py_CLEAR(self->py_validate_held);
    Py_CLEAR(self->settle_released);
    Py_CLEAR(self->py_release_table);
    Py_CLEAR(self->drop_last_refs);
    Py_CLEAR(self->writers_map);
    Py_CLEAR(self->pending_map);
    Py_CLEAR(self->retention_map);
    return 0;
}

static int
FastPath_init(FastPath *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"block_type", "blocks", "free_queue", "empty", "quarantined",
                             "index", "allocated", "written_from_allocated", "written",
                             "free", "validated", "published", "quarantined_state",
                             "stays_cached", "acquirable",
                             "evict_to", "counters", "block_removed", "zero_blocks",
                             "tainted", "events", "writers", "deferred", "retention",
                             "zero_all", "zero_suspect", NULL};
    PyObject *block_type, *blocks, *free_queue, *empty, *quarantined, *index;
    PyObject *st[7], *stays_cached, *acquirable, *evict_to, *counters, *block_removed;
    PyObject *zero_blocks, *tainted, *events, *writers_map, *pending_map, *retention_map;
    int zero_all, zero_suspect;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OO!O!O!OOOOOOOO!O!O!OOO!O!OO!O!O!pp", kwlist,
                                     &PyType_Type, &block_type, &PyList_Type, &blocks,
                                     &free_queue, &PyList_Type, &empty, &PyList_Type,
                                     &quarantined, &PyDict_Type, &index, &st[0], &st[1], &st[2],
                                     &st[3], &st[4], &st[5], &st[6], &PyTuple_Type, &stays_cached,
                                     &PyTuple_Type, &acquirable, &PyDict_Type, &evict_to,
                                     &counters, &block_removed, &PyDict_Type, &zero_blocks,
                                     &PySet_Type, &tainted, &events, &PyDict_Type,
                                     &writers_map, &PyDict_Type, &pending_map, &PyDict_Type,
                                     &retention_map, &zero_all, &zero_suspect))
        return -1;
    if (events != Py_None && !PyList_CheckExact(events)) {
        PyErr_SetString(PyExc_TypeError, "FastPath: events must be a list or None");
        return -1;
    }
    if (!PyList_CheckExact(blocks) || !PyList_CheckExact(empty) ||
        !PyList_CheckExact(quarantined) || !PyDict_CheckExact(index)) {
        PyErr_SetString(PyExc_TypeError, "FastPath needs plain lists and a plain dict");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_TYPE(PyList_GET_ITEM(blocks, i)) != (PyTypeObject *)block_type) {
            PyErr_SetString(PyExc_TypeError, "every block record must be of block_type");
            return -1;
        }
    }
#define OFF(field)                                                         \
    if ((self->off_##field = slot_offset(block_type, #field)) < 0)         \
        return -1;
    OFF(block_id)
    OFF(state)
    OFF(ref_cnt)
    OFF(block_hash)
    OFF(parent_hash)
    OFF(generation)
    OFF(external_refs)
#undef OFF
    PyObject *queue_type = (PyObject *)Py_TYPE(free_queue);
    PyObject *counters_type = (PyObject *)Py_TYPE(counters);
    if ((self->off_size = slot_offset(queue_type, "size")) < 0 ||
        (self->off_first = slot_offset(queue_type, "first")) < 0 ||
        (self->off_num_evictable = slot_offset(queue_type, "num_evictable")) < 0 ||
        (self->off_evictable = slot_offset(queue_type, "evictable")) < 0 ||
        (self->off_blocks_published = slot_offset(counters_type, "blocks_published")) < 0 ||
        (self->off_deferred_publications =
             slot_offset(counters_type, "deferred_publications")) < 0 ||
        (self->off_blocks_evicted =
             slot_offset((PyObject *)Py_TYPE(counters), "blocks_evicted")) < 0 ||
        (self->off_blocks_zeroed =
             slot_offset((PyObject *)Py_TYPE(counters), "blocks_zeroed")) < 0 ||
        (self->off_blocks_quarantined =
             slot_offset((PyObject *)Py_TYPE(counters), "blocks_quarantined")) < 0)
        return -1;
    Py_INCREF(block_type);
    Py_XSETREF(self->block_type, (PyTypeObject *)block_type);
#define KEEP(member, value) \
    Py_INCREF(value);       \
    Py_XSETREF(self->member, value);
    KEEP(blocks, blocks)
    KEEP(free_queue, free_queue)
    KEEP(empty, empty)
    KEEP(quarantined, quarantined)
    KEEP(index, index)
    KEEP(st_allocated, st[0])
    KEEP(st_written_from_allocated, st[1])
    KEEP(st_written, st[2])
    KEEP(st_free, st[3])
    KEEP(st_validated, st[4])
    KEEP(st_published, st[5])
    KEEP(st_quarantined, st[6])
    KEEP(stays_cached, stays_cached)
    KEEP(acquirable, acquirable)
    KEEP(evict_to, evict_to)
    KEEP(counters, counters)
    KEEP(block_removed, block_removed)
    KEEP(zero_blocks, zero_blocks)
    KEEP(tainted, tainted)
    KEEP(events, events)
    KEEP(writers_map, writers_map)
    KEEP(pending_map, pending_map)
    KEEP(retention_map, retention_map)
#undef KEEP
    Py_XSETREF(self->zero_int, PyLong_FromLong(0));
    Py_XSETREF(self->one_int, PyLong_FromLong(1));
    if (self->zero_int == NULL || self->one_int == NULL)
        return -1;
    self->zero_all = zero_all;
    self->zero_suspect = zero_suspect;
    return 0;
}

/* Evict `count` cached blocks from the free queue's lowest retention classes, as
 * FreeQueue.take and TransitionKernel._evict do (the caller checked they are there): their ids
 * are set in ids[start:], each block EVICTed (its hash leaves the index), and one
 * BlockRemoved event appended to `events` unless it is None. */
static int
evict_into(FastPath *self, PyObject *ids, Py_ssize_t start, Py_ssize_t count, PyObject *events)
{
    PyObject *hashes = PyTuple_New(count), *evicted = PyTuple_New(count);
    if (hashes == NULL || evicted == NULL)
        goto error;
    Py_ssize_t k = 0;
    while (k < count) {
        PyObject *first = FIELD(self->free_queue, self->off_first);
        if (first == NULL || !PyTuple_CheckExact(first) || PyTuple_GET_SIZE(first) != 2) {
            PyErr_SetString(PyExc_RuntimeError, "kvguard: free queue has no eviction class");
            goto error;
        }
        PyObject *retention = PyTuple_GET_ITEM(first, 0);
        PyObject *bucket = PyTuple_GET_ITEM(first, 1);
        Py_INCREF(retention);
        Py_INCREF(bucket);
        PyObject *popitem = PyObject_GetAttrString(bucket, "popitem");
        Py_ssize_t in_bucket = PyObject_Size(bucket);
        int failed = popitem == NULL || in_bucket < 0;
        while (!failed && k < count && in_bucket > 0) {
            PyObject *item = PyObject_CallOneArg(popitem, Py_False);
            if (item == NULL) {
                failed = 1;
                break;
            }
            PyObject *id_obj = PyTuple_GET_ITEM(item, 0);
            Py_INCREF(id_obj);
            Py_DECREF(item);
            PyTuple_SET_ITEM(evicted, k, id_obj);
            k++;
            in_bucket--;
        }
        Py_XDECREF(popitem);
        if (!failed && in_bucket == 0) {
            PyObject *r = PyObject_CallMethod(self->free_queue, "drop_eviction_class", "O", retention);
            failed = r == NULL;
            Py_XDECREF(r);
        }
        Py_DECREF(retention);
        Py_DECREF(bucket);
        if (failed)
            goto error;
    }
    if (bump_field(self->free_queue, self->off_num_evictable, -count) < 0)
        goto error;
    for (k = 0; k < count; k++) {
        PyObject *id_obj = PyTuple_GET_ITEM(evicted, k);
        PyObject *block = block_of(self, id_obj);
        if (block == NULL) {
            PyErr_Format(PyExc_RuntimeError, "kvguard: free queue holds %R", id_obj);
            goto error;
        }
        PyObject *state = FIELD(block, self->off_state);
        PyObject *new_state = PyDict_GetItemWithError(self->evict_to, state);
        PyObject *block_hash = FIELD(block, self->off_block_hash);
        if (new_state == NULL || block_hash == NULL || block_hash == Py_None) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_RuntimeError, "kvguard: evicting block %R in state %R",
                             id_obj, state);
            goto error;
        }
        set_field(block, self->off_state, new_state);
        Py_INCREF(block_hash);
        PyTuple_SET_ITEM(hashes, k, block_hash);
        if (PyDict_DelItem(self->index, block_hash) < 0)
            goto error;
        set_field(block, self->off_block_hash, Py_None);
        set_field(block, self->off_parent_hash, Py_None);
        Py_INCREF(id_obj);
        PyList_SET_ITEM(ids, start + k, id_obj);
    }
    if (bump_field(self->counters, self->off_blocks_evicted, count) < 0)
        goto error;
    if (events != Py_None) {
        PyObject *event = PyObject_CallFunctionObjArgs(self->block_removed, hashes, evicted, NULL);
        if (event == NULL || PyList_Append(events, event) < 0) {
            Py_XDECREF(event);
            goto error;
        }
        Py_DECREF(event);
    }
    Py_DECREF(hashes);
    Py_DECREF(evicted);
    return 0;
error:
    Py_XDECREF(hashes);
    Py_XDECREF(evicted);
    return -1;
}

/* Move the last `count` ids of `from` into ids[start:], last one first (as FreeQueue
 * hands them out: ids = from[-count:]; del from[-count:]; ids.reverse()). */
static int
take_tail(PyObject *from, Py_ssize_t count, PyObject *ids, Py_ssize_t start)
{
    Py_ssize_t len = PyList_GET_SIZE(from);
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *id_obj = PyList_GET_ITEM(from, len - 1 - k);
        Py_INCREF(id_obj);
        PyList_SET_ITEM(ids, start + k, id_obj);
    }
    return PyList_SetSlice(from, len - count, len, NULL);
}

/* Whether the last `count` ids of `from` all name blocks of the pool whose generation
 * is a plain int (so that handing them out cannot stop half-way). */
static int
tail_is_sound(FastPath *self, PyObject *from, Py_ssize_t count)
{
    Py_ssize_t len = PyList_GET_SIZE(from);
    long generation;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *block = block_of(self, PyList_GET_ITEM(from, len - 1 - k));
        if (block == NULL || !get_long(block, self->off_generation, &generation))
            return 0;
    }
    return 1;
}

/* allocate(n, held, write) -> list[int]
 *
 * TransitionKernel.allocate(n, held, write) unless the zeroing policy is "all": the ids
 * FreeQueue.take(n) hands out -- quarantined blocks first (queued for zeroing under
 * the "suspect" policy), then FREE ones, then cached ones in eviction order, which are
 * EVICTed (their hashes leave the index; one BlockRemoved event in the event log unless
 * events are not recorded) -- each block then ALLOCATED (or WRITTEN by one step),
 * ref_cnt 1 (a block-level reference if held), its generation bumped. Otherwise
 * nothing is taken here and the Python primitive decides (or raises OutOfBlocksError).
 */
static PyObject *
FastPath_allocate(FastPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "allocate(n, held, write)");
        return NULL;
    }
    PyObject *events = self->events;
    if (self->blocks == NULL || self->zero_all || !PyLong_CheckExact(args[0]))
        DECLINE(py_allocate);
    Py_ssize_t n = PyLong_AsSsize_t(args[0]);
    if (n == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        DECLINE(py_allocate);
    }
    int held = PyObject_IsTrue(args[1]);
    if (held < 0)
        return NULL;
    int write = PyObject_IsTrue(args[2]);
    if (write < 0)
        return NULL;
    long size, generation = 0, blocks_zeroed = 0;
    if (n <= 0 || !get_long(self->free_queue, self->off_size, &size) || size < n)
        DECLINE(py_allocate);
    Py_ssize_t num_quarantined = PyList_GET_SIZE(self->quarantined);
    if (num_quarantined > n)
        num_quarantined = n;
    Py_ssize_t num_empty = PyList_GET_SIZE(self->empty);
    if (num_empty > n - num_quarantined)
        num_empty = n - num_quarantined;
    if (!tail_is_sound(self, self->quarantined, num_quarantined) ||
        !tail_is_sound(self, self->empty, num_empty) ||
        (num_quarantined && self->zero_suspect &&
         !get_long(self->counters, self->off_blocks_zeroed, &blocks_zeroed)))
        DECLINE(py_allocate);
    PyObject *ids = PyList_New(n);
    if (ids == NULL)
        return NULL;
    if (take_tail(self->quarantined, num_quarantined, ids, 0) < 0 ||
        take_tail(self->empty, num_empty, ids, num_quarantined) < 0 ||
        add_to_field(self->free_queue, self->off_size, size, -n) < 0)
        goto error;
    if (num_quarantined && self->zero_suspect) {
        /* Suspect bytes: the engine zeroes them before the new owner's step runs. */
        for (Py_ssize_t k = 0; k < num_quarantined; k++)
            if (PyDict_SetItem(self->zero_blocks, PyList_GET_ITEM(ids, k), Py_None) < 0)
                goto error;
        if (add_to_field(self->counters, self->off_blocks_zeroed, blocks_zeroed,
                         num_quarantined) < 0)
            goto error;
    }
    Py_ssize_t taken = num_quarantined + num_empty;
    if (taken < n && evict_into(self, ids, taken, n - taken, events) < 0)
        goto error;
    PyObject *one = self->one_int, *zero = self->zero_int; /* borrowed */
    PyObject *state = write ? self->st_written_from_allocated : self->st_allocated;
    int failed = 0;
    for (Py_ssize_t k = 0; k < n && !failed; k++) {
        PyObject *block = block_of(self, PyList_GET_ITEM(ids, k));
        if (!get_long(block, self->off_generation, &generation)) {
            PyErr_SetString(PyExc_RuntimeError, "kvguard: a block's generation is not an int");
            failed = 1;
            break;
        }
        set_field(block, self->off_state, state);
        set_field(block, self->off_ref_cnt, one);
        set_field(block, self->off_external_refs, held ? one : zero);
        /* (a block in the free queue has no writer: only a written one gets one) */
        if (write && PyDict_SetItem(self->writers_map, PyList_GET_ITEM(ids, k), one) < 0) {
            failed = 1;
            break;
        }
        failed = add_to_field(block, self->off_generation, generation, 1) < 0;
    }
    if (failed)
        goto error;
    return ids;
error:
    Py_DECREF(ids);
    return NULL;
}

/* FreeQueue.push_evictable(blocks): cached blocks whose last reference went join
 * their retention class's eviction queue, blocks[0] to be evicted first. */
static int
enqueue_evictable(FastPath *self, PyObject *blocks)
{
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    if (n == 0)
        return 0;
    PyObject *key = NULL, *bucket = NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *block = PyList_GET_ITEM(blocks, k);
        PyObject *retention = retention_of(self, FIELD(block, self->off_block_id));
        if (retention == NULL)
            goto error;
        int same = 0;
        if (key != NULL) {
            same = PyObject_RichCompareBool(retention, key, Py_EQ);
            if (same < 0)
                goto error;
        }
        if (!same) {
            Py_XSETREF(bucket, PyObject_CallMethod(self->free_queue, "eviction_class", "O", retention));
            if (bucket == NULL)
                goto error;
            Py_INCREF(retention);
            Py_XSETREF(key, retention);
        }
        if (PyObject_SetItem(bucket, FIELD(block, self->off_block_id), Py_None) < 0)
            goto error;
    }
    Py_XDECREF(key);
    Py_XDECREF(bucket);
    if (bump_field(self->free_queue, self->off_num_evictable, n) < 0 ||
        bump_field(self->free_queue, self->off_size, n) < 0)
        return -1;
    return 0;
error:
    Py_XDECREF(key);
    Py_XDECREF(bucket);
    return -1;
}

/* FreeQueue.push_evictable_ids(retention, ids): cached blocks of one retention class
 * join its eviction queue, ids[0] to be evicted first. */
static int
enqueue_evictable_ids(FastPath *self, PyObject *retention, PyObject *ids)
{
    Py_ssize_t n = PyList_GET_SIZE(ids);
    if (n == 0)
        return 0;
    PyObject *bucket = PyObject_CallMethod(self->free_queue, "eviction_class", "O", retention);
    if (bucket == NULL)
        return -1;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (PyObject_SetItem(bucket, PyList_GET_ITEM(ids, k), Py_None) < 0) {
            Py_DECREF(bucket);
            return -1;
        }
    }
    Py_DECREF(bucket);
    if (bump_field(self->free_queue, self->off_num_evictable, n) < 0 ||
        bump_field(self->free_queue, self->off_size, n) < 0)
        return -1;
    return 0;
}

/* release_held(ids: list[int], steps_passed) -> None
 *
 * TransitionKernel.release_held: one block-level reference of each id in turn; a block whose last reference goes is *cached* (a state a release leaves
 * cached), *freed* (ALLOCATED, or WRITTEN with steps_passed and no publication
 * waiting: it becomes FREE and joins the free queue's FREE blocks here),
 * *quarantined* (WRITTEN without steps_passed, or QUARANTINED already: it joins the
 * quarantined blocks here), or *released* (anything else). Cached blocks join their eviction queue here too
 * (FreeQueue.push_evictable). The released blocks, in release order, are settled by
 * the kernel's settle_released. If some id cannot be released (not an id of the pool,
 * or no block-level reference left), every reference dropped before it is restored,
 * nothing changed, and the Python primitive runs (and names the error).
 */
static PyObject *
FastPath_release(FastPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "release_held(ids, steps_passed)");
        return NULL;
    }
    PyObject *ids = args[0];
    if (self->blocks == NULL || !PyList_CheckExact(ids))
        DECLINE(py_release_held);
    int steps_passed = PyObject_IsTrue(args[1]);
    if (steps_passed < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    /* Checking pass: every block's counters are plain ints (so that the applying pass
     * cannot stop half-way on them), and references suffice. Duplicates are checked
     * in the applying pass, which undoes itself if one lacks a reference. */
    long refs = 0, ref_cnt = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *block = block_of(self, PyList_GET_ITEM(ids, k));
        if (block == NULL || !get_long(block, self->off_external_refs, &refs) || refs <= 0 ||
            !get_long(block, self->off_ref_cnt, &ref_cnt) || ref_cnt < refs)
            DECLINE(py_release_held);
    }
    PyObject *cached = PyList_New(0), *released = PyList_New(0), *freed = PyList_New(0),
             *quarantined = PyList_New(0);
    if (cached == NULL || released == NULL || freed == NULL || quarantined == NULL)
        goto error;
    Py_ssize_t done = 0;
    for (; done < n; done++) {
        PyObject *block = block_of(self, PyList_GET_ITEM(ids, done));
        get_long(block, self->off_external_refs, &refs);
        if (refs <= 0)
            break; /* a duplicate id holding fewer references than it is named */
        get_long(block, self->off_ref_cnt, &ref_cnt);
        if (add_to_field(block, self->off_external_refs, refs, -1) < 0 ||
            add_to_field(block, self->off_ref_cnt, ref_cnt, -1) < 0)
            goto error;
        if (ref_cnt == 1) {
            PyObject *state = FIELD(block, self->off_state);
            PyObject *into;
            int deferred = 0;
            if (steps_passed && state == self->st_written) {
                deferred = PyDict_Contains(self->pending_map, FIELD(block, self->off_block_id));
                if (deferred < 0)
                    goto error;
            }
            if (in_tuple(self->stays_cached, state))
                into = cached;
            else if (state == self->st_allocated ||
                     (steps_passed && state == self->st_written && !deferred))
                into = freed;
            else if ((!steps_passed && state == self->st_written) ||
                     state == self->st_quarantined)
                into = quarantined;
            else
                into = released;
            if (PyList_Append(into, block) < 0)
                goto error;
        }
    }
    if (done != n) {
        for (Py_ssize_t k = 0; k < done; k++) {
            PyObject *block = block_of(self, PyList_GET_ITEM(ids, k));
            get_long(block, self->off_external_refs, &refs);
            get_long(block, self->off_ref_cnt, &ref_cnt);
            if (add_to_field(block, self->off_external_refs, refs, 1) < 0 ||
                add_to_field(block, self->off_ref_cnt, ref_cnt, 1) < 0)
                goto error;
        }
        Py_DECREF(cached);
        Py_DECREF(released);
        Py_DECREF(freed);
        Py_DECREF(quarantined);
        DECLINE(py_release_held);
    }
    /* ALLOCATED --RELEASE--> FREE, and WRITTEN --VALIDATE--> VALIDATED --RELEASE-->
     * FREE (the Python side checks at import that the table agrees). */
    Py_ssize_t num_freed = PyList_GET_SIZE(freed);
    if (num_freed) {
        for (Py_ssize_t k = 0; k < num_freed; k++) {
            PyObject *block = PyList_GET_ITEM(freed, k);
            PyObject *id_obj = FIELD(block, self->off_block_id);
            set_field(block, self->off_state, self->st_free);
            if ((PyDict_GET_SIZE(self->writers_map) && forget(self->writers_map, id_obj) < 0) ||
                /* a deferred publication dies with the last holder */
                (PyDict_GET_SIZE(self->pending_map) && forget(self->pending_map, id_obj) < 0) ||
                PyList_Append(self->empty, id_obj) < 0)
                goto error;
        }
        if (bump_field(self->free_queue, self->off_size, num_freed) < 0)
            goto error;
    }
    /* WRITTEN --RELEASE--> QUARANTINED (TransitionKernel._quarantine: its step can never be
     * validated now), and a held QUARANTINED block let go; both join the queue of
     * blocks reused first, in release order (TransitionKernel._drop_last_refs). */
    Py_ssize_t num_quarantined = PyList_GET_SIZE(quarantined);
    if (num_quarantined) {
        long generation, newly = 0;
        for (Py_ssize_t k = 0; k < num_quarantined; k++) {
            PyObject *block = PyList_GET_ITEM(quarantined, k);
            PyObject *id_obj = FIELD(block, self->off_block_id);
            if (PyDict_GET_SIZE(self->pending_map) && forget(self->pending_map, id_obj) < 0)
                goto error;
            if (FIELD(block, self->off_state) == self->st_written) {
                set_field(block, self->off_state, self->st_quarantined);
                set_field(block, self->off_block_hash, Py_None);
                set_field(block, self->off_parent_hash, Py_None);
                if (forget(self->writers_map, id_obj) < 0)
                    goto error;
                if (!get_long(block, self->off_generation, &generation) ||
                    add_to_field(block, self->off_generation, generation, 1) < 0) {
                    if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_RuntimeError, "kvguard: a generation is not an int");
                    goto error;
                }
                newly++;
            }
            if (PyList_Append(self->quarantined, id_obj) < 0)
                goto error;
        }
        if (bump_field(self->free_queue, self->off_size, num_quarantined) < 0 ||
            (newly && bump_field(self->counters, self->off_blocks_quarantined, newly) < 0))
            goto error;
    }
    Py_DECREF(freed);
    Py_DECREF(quarantined);
    if (enqueue_evictable(self, cached) < 0)
        goto error;
    Py_DECREF(cached);
    if (PyList_GET_SIZE(released) == 0) {
        Py_DECREF(released);
        Py_RETURN_NONE;
    }
    /* Blocks neither cached nor plainly freed: the Python side settles them. */
    PyObject *settled = PyObject_CallFunctionObjArgs(self->settle_released, released, args[1], NULL);
    Py_DECREF(released);
    return settled;
error:
    Py_XDECREF(cached);
    Py_XDECREF(released);
    Py_XDECREF(freed);
    Py_XDECREF(quarantined);
    return NULL;
}

/* release_table(table: list[int], retention: int) -> None
 *
 * TransitionKernel.release_table: a request is gone, so one reference of each block of
 * its table is dropped, tail first. Blocks whose last reference goes and whose state a
 * release leaves cached take the request's retention class (the retention map) and
 * join that class's eviction queue, in release order (FreeQueue.push_evictable_ids);
 * the others, in release order, are settled by the kernel's drop_last_refs. Declines
 * (nothing changed; the Python primitive runs) unless the table is a list of the
 * pool's block ids whose reference counts are ints, and the retention an int.
 */
static PyObject *
FastPath_release_table(FastPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "release_table(table, retention)");
        return NULL;
    }
    PyObject *table = args[0], *retention = args[1];
    if (self->blocks == NULL || !PyList_CheckExact(table) || !PyLong_CheckExact(retention))
        DECLINE(py_release_table);
    int keep_class = PyObject_IsTrue(retention); /* retention != 0 */
    if (keep_class < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(table);
    long ref_cnt = 0;
    /* Checking pass: the applying pass cannot stop half-way. */
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *block = block_of(self, PyList_GET_ITEM(table, k));
        if (block == NULL || !get_long(block, self->off_ref_cnt, &ref_cnt))
            DECLINE(py_release_table);
    }
    PyObject *cached = PyList_New(0), *released = PyList_New(0);
    if (cached == NULL || released == NULL)
        goto error;
    for (Py_ssize_t k = n - 1; k >= 0; k--) {
        PyObject *block = block_of(self, PyList_GET_ITEM(table, k));
        get_long(block, self->off_ref_cnt, &ref_cnt); /* (re-read: an id may repeat) */
        if (add_to_field(block, self->off_ref_cnt, ref_cnt, -1) < 0)
            goto error;
        if (ref_cnt != 1)
            continue;
        int stays = in_tuple(self->stays_cached, FIELD(block, self->off_state));
        if (PyList_Append(stays ? cached : released, stays ? FIELD(block, self->off_block_id)
                                                           : block) < 0)
            goto error;
    }
    /* TransitionKernel._set_retention, then the eviction queue of that class. */
    Py_ssize_t num_cached = PyList_GET_SIZE(cached);
    if (keep_class || PyDict_GET_SIZE(self->retention_map)) {
        for (Py_ssize_t k = 0; k < num_cached; k++) {
            PyObject *id_obj = PyList_GET_ITEM(cached, k);
            if (keep_class ? PyDict_SetItem(self->retention_map, id_obj, retention) < 0
                           : forget(self->retention_map, id_obj) < 0)
                goto error;
        }
    }
    if (enqueue_evictable_ids(self, retention, cached) < 0)
        goto error;
    Py_CLEAR(cached);
    if (PyList_GET_SIZE(released) == 0) {
        Py_DECREF(released);
        Py_RETURN_NONE;
    }
    PyObject *dropped = PyObject_CallFunctionObjArgs(self->drop_last_refs, released, retention, NULL);
    Py_DECREF(released);
    return dropped;
error:
    Py_XDECREF(cached);
    Py_XDECREF(released);
    return NULL;
}

/* validate_held(ids: list[int], publish: dict | None)
 *     -> (validated, published, duplicates)
 *
 * TransitionKernel.validate_held's usual case, while events are not recorded (the
 * Python primitive runs otherwise): ids distinct, each block WRITTEN by exactly one
 * step in flight (checked here: otherwise nothing changed and the Python primitive
 * runs). Each becomes VALIDATED; its publication -- publish[id] if there is
 * one (counted in held), else the one it carries -- happens now: the hash and parent
 * set, and PUBLISHED in the index unless the index holds that hash already (then a
 * duplicate, VALIDATED with its hash). Publications and held ones are counted.
 */
static PyObject *
FastPath_validate(FastPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "validate_held(ids, publish)");
        return NULL;
    }
    PyObject *ids = args[0], *publish = args[1];
    if (self->blocks == NULL || self->events != Py_None || !PyList_CheckExact(ids) ||
        (publish != Py_None && !PyDict_CheckExact(publish)))
        DECLINE(py_validate_held);
    Py_ssize_t n = PyList_GET_SIZE(ids);
    /* Checking pass: a block counted here loses its one writer, so that an id named
     * twice fails the check; on failure the writers are given back. */
    Py_ssize_t checked = 0;
    for (; checked < n; checked++) {
        PyObject *id_obj = PyList_GET_ITEM(ids, checked);
        PyObject *block = block_of(self, id_obj);
        if (block == NULL || FIELD(block, self->off_state) != self->st_written)
            break;
        PyObject *writers = PyDict_GetItemWithError(self->writers_map, id_obj);
        if (writers == NULL) {
            PyErr_Clear();
            break;
        }
        if (!PyLong_CheckExact(writers) || PyLong_AsLong(writers) != 1) {
            PyErr_Clear();
            break;
        }
        PyObject *pending = NULL;
        if (publish != Py_None) {
            pending = PyDict_GetItemWithError(publish, PyList_GET_ITEM(ids, checked));
            if (pending == NULL && PyErr_Occurred())
                PyErr_Clear();
            if (pending == Py_None)
                pending = NULL; /* publish.get() gives None: no publication held */
        }
        if (pending == NULL) {
            pending = PyDict_GetItemWithError(self->pending_map, id_obj);
            if (pending == NULL) {
                if (PyErr_Occurred())
                    break;
                pending = Py_None;
            }
        }
        if (pending != Py_None &&
            (!PyTuple_CheckExact(pending) || PyTuple_GET_SIZE(pending) != 3 ||
             !PyBytes_CheckExact(PyTuple_GET_ITEM(pending, 0))))
            break; /* not a (bytes hash, parent, owner): the Python path decides */
        if (pending != Py_None && PySet_GET_SIZE(self->tainted)) {
            /* A tainted hash, or one chained on it: the Python path refuses or
             * clears the taint (TransitionKernel.validate_held). */
            int hit = PySet_Contains(self->tainted, PyTuple_GET_ITEM(pending, 0));
            if (hit == 0)
                hit = PySet_Contains(self->tainted, PyTuple_GET_ITEM(pending, 1));
            if (hit != 0) {
                if (hit < 0)
                    PyErr_Clear();
                break;
            }
        }
        if (PyDict_DelItem(self->writers_map, id_obj) < 0)
            break;
    }
    if (checked != n) {
        PyErr_Clear();
        for (Py_ssize_t k = 0; k < checked; k++)
            if (PyDict_SetItem(self->writers_map, PyList_GET_ITEM(ids, k), self->one_int) < 0)
                return NULL;
        DECLINE(py_validate_held);
    }
    PyObject *published = PyList_New(0), *duplicates = PyList_New(0);
    if (published == NULL || duplicates == NULL)
        goto error;
    Py_ssize_t held = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *id_obj = PyList_GET_ITEM(ids, k);
        PyObject *block = block_of(self, id_obj);
        set_field(block, self->off_state, self->st_validated); /* writers: gone above */
        PyObject *pending = NULL;
        if (publish != Py_None) {
            pending = PyDict_GetItemWithError(publish, id_obj);
            if (pending == NULL && PyErr_Occurred())
                goto error;
            if (pending == Py_None)
                pending = NULL;
        }
        if (pending == NULL) {
            pending = PyDict_GetItemWithError(self->pending_map, id_obj);
            if (pending == NULL) {
                if (PyErr_Occurred())
                    goto error;
                continue;
            }
        }
        else {
            held++;
        }
        Py_INCREF(pending);
        if (forget(self->pending_map, id_obj) < 0) {
            Py_DECREF(pending);
            goto error;
        }
        PyObject *block_hash = PyTuple_GET_ITEM(pending, 0);
        set_field(block, self->off_block_hash, block_hash);
        set_field(block, self->off_parent_hash, PyTuple_GET_ITEM(pending, 1));
        int known = PyDict_Contains(self->index, block_hash);
        if (known < 0) {
            Py_DECREF(pending);
            goto error;
        }
        if (known) {
            Py_DECREF(pending);
            if (PyList_Append(duplicates, id_obj) < 0)
                goto error;
            continue;
        }
        set_field(block, self->off_state, self->st_published);
        int failed = PyDict_SetItem(self->index, block_hash, id_obj) < 0 ||
                     PyList_Append(published, id_obj) < 0;
        Py_DECREF(pending);
        if (failed)
            goto error;
    }
    if ((held && bump_field(self->counters, self->off_deferred_publications, held) < 0) ||
        (PyList_GET_SIZE(published) &&
         bump_field(self->counters, self->off_blocks_published, PyList_GET_SIZE(published)) < 0))
        goto error;
    PyObject *result = PyTuple_Pack(3, ids, published, duplicates);
    Py_DECREF(published);
    Py_DECREF(duplicates);
    return result;
error:
    Py_XDECREF(published);
    Py_XDECREF(duplicates);
    return NULL;
}

/* FreeQueue.remove_evictable(block): a cached block with no reference leaves its
 * retention class's eviction queue (a prefix hit takes it). */
static int
take_out_of_eviction(FastPath *self, PyObject *block)
{
    PyObject *classes = FIELD(self->free_queue, self->off_evictable);
    PyObject *retention = retention_of(self, FIELD(block, self->off_block_id));
    if (classes == NULL || retention == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvguard: free queue without eviction classes");
        return -1;
    }
    PyObject *bucket = PyObject_GetItem(classes, retention);
    if (bucket == NULL)
        return -1;
    Py_ssize_t left = -1;
    if (PyObject_DelItem(bucket, FIELD(block, self->off_block_id)) == 0)
        left = PyObject_Size(bucket);
    Py_DECREF(bucket);
    if (left < 0)
        return -1;
    if (left == 0) {
        PyObject *r = PyObject_CallMethod(self->free_queue, "drop_eviction_class", "O", retention);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    if (bump_field(self->free_queue, self->off_num_evictable, -1) < 0 ||
        bump_field(self->free_queue, self->off_size, -1) < 0)
        return -1;
    return 0;
}

/* acquire(ids: list[int], held) -> None
 *
 * TransitionKernel.acquire(ids, held): every id names a block in a state ACQUIRE
 * leaves as it is (PUBLISHED/OFFLOADED), else nothing changed and the Python
 * primitive runs (and names the error). Each takes a
 * reference (a block-level one if held); a block taken from zero references leaves
 * the eviction queue.
 */
static PyObject *
FastPath_acquire(FastPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "acquire(ids, held)");
        return NULL;
    }
    PyObject *ids = args[0];
    int held = PyObject_IsTrue(args[1]);
    if (held < 0)
        return NULL;
    if (self->blocks == NULL || !PyList_CheckExact(ids))
        DECLINE(py_acquire);
    Py_ssize_t n = PyList_GET_SIZE(ids);
    long refs = 0, ref_cnt = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *block = block_of(self, PyList_GET_ITEM(ids, k));
        if (block == NULL || !in_tuple(self->acquirable, FIELD(block, self->off_state)) ||
            !get_long(block, self->off_external_refs, &refs) ||
            !get_long(block, self->off_ref_cnt, &ref_cnt))
            DECLINE(py_acquire);
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *block = block_of(self, PyList_GET_ITEM(ids, k));
        get_long(block, self->off_ref_cnt, &ref_cnt);
        if (!ref_cnt) {
            if (take_out_of_eviction(self, block) < 0)
                return NULL;
        }
        get_long(block, self->off_external_refs, &refs);
        if (add_to_field(block, self->off_ref_cnt, ref_cnt, 1) < 0 ||
            (held && add_to_field(block, self->off_external_refs, refs, 1) < 0))
            return NULL;
    }
    Py_RETURN_NONE;
}

/* fallbacks(allocate, acquire, release_held, validate_held, release_table,
 *           settle_released, drop_last_refs)
 *
 * The Python primitives the twins stand for, and the ends of release_held and
 * release_table in Python. */
static PyObject *
FastPath_fallbacks(FastPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "fallbacks(allocate, acquire, release_held, validate_held, "
                        "release_table, settle_released, drop_last_refs)");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < 7; k++) {
        if (!PyCallable_Check(args[k])) {
            PyErr_SetString(PyExc_TypeError, "FastPath.fallbacks() takes callables");
            return NULL;
        }
    }
    PyObject **slots[7] = {&self->py_allocate,      &self->py_acquire,      &self->py_release_held,
                           &self->py_validate_held, &self->py_release_table, &self->settle_released,
                           &self->drop_last_refs};
    for (Py_ssize_t k = 0; k < 7; k++) {
        Py_INCREF(args[k]);
        Py_XSETREF(*slots[k], args[k]);
    }
    Py_RETURN_NONE;
}

static PyMethodDef FastPath_methods[] = {
    {"allocate", (PyCFunction)(void (*)(void))FastPath_allocate, METH_FASTCALL,
     "allocate(n, held, write) -> list[int]"},
    {"release_held", (PyCFunction)(void (*)(void))FastPath_release, METH_FASTCALL,
     "release_held(ids, steps_passed) -> None"},
    {"validate_held", (PyCFunction)(void (*)(void))FastPath_validate, METH_FASTCALL,
     "validate_held(ids, publish) -> (validated, published, duplicates)"},
    {"acquire", (PyCFunction)(void (*)(void))FastPath_acquire, METH_FASTCALL,
     "acquire(ids, held) -> None"},
    {"release_table", (PyCFunction)(void (*)(void))FastPath_release_table, METH_FASTCALL,
     "release_table(table, retention) -> None"},
    {"fallbacks", (PyCFunction)(void (*)(void))FastPath_fallbacks, METH_FASTCALL,
     "fallbacks(allocate, acquire, release_held, validate_held, release_table, "
     "settle_released, drop_last_refs)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvguard._speedups.FastPath",
    .tp_doc = "Compiled fast paths of one pool's block-level hot operations.",
    .tp_basicsize = sizeof(FastPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FastPath_init,
    .tp_dealloc = (destructor)FastPath_dealloc,
    .tp_traverse = (traverseproc)FastPath_traverse,
    .tp_clear = (inquiry)FastPath_clear,
    .tp_methods = FastPath_methods,
};

/* FillNotes: the vLLM adapter's noting of the blocks a step being scheduled fills.
 *
 * GuardedBlockPool.cache_full_blocks (kvguard/adapters/vllm/pool/block_pool.py) does not
 * publish a full block while the step that fills it is being scheduled: it notes the
 * block as filled by that step and the publication it is due, (key, parent key,
 * owner), for the step's output to validate. note() does that loop for the common
 * case -- every block in the range still WRITTEN (being written by the step), no block
 * mask, no KV events -- with exactly the Python loop's effects, or changes nothing and
 * returns None (the Python loop runs).
 */
typedef struct {
    PyObject_HEAD
    PyTypeObject *block_type;
    PyObject *written;
    Py_ssize_t off_block_id, off_state, off_num_hash_tokens;
} FillNotes;

static void
FillNotes_dealloc(FillNotes *self)
{
    Py_CLEAR(self->block_type);
    Py_CLEAR(self->written);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
FillNotes_init(FillNotes *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"block_type", "written", NULL};
    PyObject *block_type, *written;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O", kwlist, &PyType_Type, &block_type,
                                     &written))
        return -1;
    if ((self->off_block_id = slot_offset(block_type, "block_id")) < 0 ||
        (self->off_state = slot_offset(block_type, "state")) < 0 ||
        (self->off_num_hash_tokens = slot_offset(block_type, "num_hash_tokens")) < 0)
        return -1;
    Py_INCREF(block_type);
    Py_XSETREF(self->block_type, (PyTypeObject *)block_type);
    Py_INCREF(written);
    Py_XSETREF(self->written, written);
    return 0;
}

/* note(blocks, hashes, start, stop, suffix, parent, owner, block_size, publications,
 *      filled) -> bool
 *
 * For i in range(start, stop): key = hashes[i] + suffix; blocks[i].num_hash_tokens =
 * (i + 1) * block_size; filled.append(blocks[i].block_id); publications[block_id] =
 * (key, parent, owner); parent = key. False, nothing changed: a block in the range is
 * not WRITTEN (or not a record of this type), a list is too short, or a hash is not
 * bytes. */
static PyObject *
FillNotes_note(FillNotes *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "note(blocks, hashes, start, stop, suffix, parent, owner, block_size, "
                        "publications, filled)");
        return NULL;
    }
    PyObject *blocks = args[0], *hashes = args[1], *suffix = args[4], *parent = args[5],
             *owner = args[6], *publications = args[8], *filled = args[9];
    if (self->block_type == NULL || !PyList_CheckExact(blocks) || !PyList_CheckExact(hashes) ||
        !PyBytes_CheckExact(suffix) || !PyDict_CheckExact(publications) ||
        !PyList_CheckExact(filled) || !PyLong_CheckExact(args[2]) ||
        !PyLong_CheckExact(args[3]) || !PyLong_CheckExact(args[7]))
        Py_RETURN_FALSE;
    Py_ssize_t start = PyLong_AsSsize_t(args[2]), stop = PyLong_AsSsize_t(args[3]);
    long block_size = PyLong_AsLong(args[7]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    if (start < 0 || stop < start || stop > PyList_GET_SIZE(blocks) ||
        stop > PyList_GET_SIZE(hashes) || block_size <= 0)
        Py_RETURN_FALSE;
    for (Py_ssize_t i = start; i < stop; i++) {
        PyObject *block = PyList_GET_ITEM(blocks, i);
        if (Py_TYPE(block) != self->block_type || FIELD(block, self->off_state) != self->written ||
            !PyBytes_CheckExact(PyList_GET_ITEM(hashes, i)))
            Py_RETURN_FALSE;
    }
    Py_INCREF(parent);
    for (Py_ssize_t i = start; i < stop; i++) {
        PyObject *block = PyList_GET_ITEM(blocks, i);
        PyObject *key = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(PyList_GET_ITEM(hashes, i)) +
                                                            PyBytes_GET_SIZE(suffix));
        if (key == NULL)
            goto error;
        PyObject *block_hash = PyList_GET_ITEM(hashes, i);
        memcpy(PyBytes_AS_STRING(key), PyBytes_AS_STRING(block_hash), PyBytes_GET_SIZE(block_hash));
        memcpy(PyBytes_AS_STRING(key) + PyBytes_GET_SIZE(block_hash), PyBytes_AS_STRING(suffix),
               PyBytes_GET_SIZE(suffix));
        PyObject *num_tokens = PyLong_FromLong((long)(i + 1) * block_size);
        PyObject *publication = num_tokens ? PyTuple_Pack(3, key, parent, owner) : NULL;
        PyObject *block_id = FIELD(block, self->off_block_id);
        if (publication == NULL || block_id == NULL || PyList_Append(filled, block_id) < 0 ||
            PyDict_SetItem(publications, block_id, publication) < 0) {
            Py_XDECREF(num_tokens);
            Py_XDECREF(publication);
            Py_DECREF(key);
            goto error;
        }
        put_field(block, self->off_num_hash_tokens, num_tokens);
        Py_DECREF(publication);
        Py_SETREF(parent, key);
    }
    Py_DECREF(parent);
    Py_RETURN_TRUE;
error:
    Py_DECREF(parent);
    return NULL;
}

static PyMethodDef FillNotes_methods[] = {
    {"note", (PyCFunction)(void (*)(void))FillNotes_note, METH_FASTCALL,
     "note(blocks, hashes, start, stop, suffix, parent, owner, block_size, publications, "
     "filled) -> bool"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FillNotesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvguard._speedups.FillNotes",
    .tp_doc = "The vLLM adapter's noting of filled blocks, compiled (see note()).",
    .tp_basicsize = sizeof(FillNotes),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FillNotes_init,
    .tp_dealloc = (destructor)FillNotes_dealloc,
    .tp_methods = FillNotes_methods,
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvguard._speedups",
    .m_doc = "Compiled fast paths of kvguard's block pool (optional; pure Python otherwise).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    if (PyType_Ready(&FastPathType) < 0 || PyType_Ready(&FillNotesType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&speedups_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FastPathType);
    if (PyModule_AddObject(m, "FastPath", (PyObject *)&FastPathType) < 0) {
        Py_DECREF(&FastPathType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&FillNotesType);
    if (PyModule_AddObject(m, "FillNotes", (PyObject *)&FillNotesType) < 0) {
        Py_DECREF(&FillNotesType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
