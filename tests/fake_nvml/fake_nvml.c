/*
 * A fake libnvidia-ml.so.1 for testing gpufail's NVML collector without a GPU.
 *
 * nvidia-ml-py (`import pynvml`) loads libnvidia-ml.so.1 with ctypes and calls its C functions
 * with the structures it declares, so this library exports the same symbols with the same
 * layouts and lets the real pynvml code path run: init, device enumeration, getters, batched
 * field values, event sets.
 *
 * Behaviour comes from a scenario file named by the environment variable FAKE_NVML_CONFIG,
 * read on every nvmlInit that finds the library not initialised. One directive per line,
 * '#' starts a comment:
 *
 *   driver <version text>
 *   init_error <nvmlReturn>                 nvmlInit fails with this code (e.g. 9: driver not loaded)
 *   no_memory_v2                            a driver before R510: nvmlDeviceGetMemoryInfo_v2 answers
 *                                           FUNCTION_NOT_FOUND, as pynvml does when the symbol is missing
 *   gpu <i> name|uuid|pci <text>            static attributes
 *   gpu <i> temp <degC>                     nvmlDeviceGetTemperature(GPU)
 *   gpu <i> util <gpu %> <memory %>         nvmlDeviceGetUtilizationRates
 *   gpu <i> clock_sm|clock_mem <MHz>        nvmlDeviceGetClockInfo
 *   gpu <i> memory <total bytes> <used bytes> [<reserved bytes>]
 *                                           used as nvidia-smi shows it (without the driver's
 *                                           reservation); v1 of nvmlDeviceGetMemoryInfo adds the
 *                                           reservation to used, as the real library does, v2 not
 *   gpu <i> clock_event_reasons <bitmask>
 *   gpu <i> power_limit <mW>                nvmlDeviceGetEnforcedPowerLimit
 *   gpu <i> field <id> <value> [type <nvmlValueType>] [step <increase per sample>]
 *   gpu <i> field_error <id> <nvmlReturn>   this field reports an error of its own
 *   gpu <i> field_double <id> <number>      a double field value as strtod reads it: inf, nan, 1e308
 *   gpu <i> fail_after <samples> <nvmlReturn>
 *   gpu <i> events <supported event type mask>
 *   event <gpu> <xid> <after samples>       an XID critical error event
 *
 * A "sample" starts with each nvmlDeviceGetFieldValues call on a device (the collector makes one
 * per GPU per collection, before that GPU's other getters). A counter field reads
 * value + step * earlier samples, so counters move between collections; a GPU with
 * `fail_after N` answers through its first N samples, then every call on it returns the given
 * code (15: GPU is lost; 0 samples: lost from the start); an event becomes readable once its
 * GPU has started `after` samples.
 * Anything not configured is NVML_ERROR_NOT_SUPPORTED, as on a board without that sensor.
 * A malformed scenario makes nvmlInit fail with NVML_ERROR_UNKNOWN and a message on stderr.
 *
 * fake_nvml_call_count(name) and fake_nvml_last_wait_timeout_ms() let a test check how the
 * collector used the library (batching, caching, a non-blocking event wait).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

enum { TYPE_DOUBLE = 0, TYPE_UINT = 1, TYPE_ULONG = 2, TYPE_ULONGLONG = 3, TYPE_SLONGLONG = 4, TYPE_SINT = 5, TYPE_USHORT = 6 };

#define MAX_GPUS 64
#define MAX_FIELDS 96
#define MAX_EVENTS 256
#define MAX_SETS 16
#define TEXT 96

/* Layouts as nvidia-ml-py declares them (c_nvmlValue_t, c_nvmlFieldValue_t, c_nvmlMemory_t,
 * c_nvmlUtilization_t, nvmlPciInfo_t, c_nvmlEventData_t). */
typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    uint32_t fieldId;
    uint32_t scopeId;
    int64_t timestamp;
    int64_t latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

/* nvmlMemory_v2 in nvml.h: the structure's size and version 2 */
#define NVML_MEMORY_V2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct fake_gpu *nvmlDevice_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct {
    unsigned int id;
    int configured;
    int value_type;
    nvmlReturn_t error;
    unsigned long long value;
    long long step;
    int is_double; /* `field_double`: `dval` is the value, whatever strtod read */
    double dval;
} fake_field;

struct fake_gpu {
    int present;
    char name[TEXT], uuid[TEXT], pci[32];
    int has_temp, has_util, has_clock_sm, has_clock_mem, has_memory, has_reasons, has_power_limit;
    unsigned int temp, util_gpu, util_mem, clock_sm, clock_mem, power_limit_mw;
    unsigned long long mem_total, mem_used, mem_reserved, reasons;
    fake_field fields[MAX_FIELDS];
    int n_fields;
    unsigned long long samples;
    long long fail_after; /* -1: never */
    nvmlReturn_t fail_code;
    unsigned long long supported_events;
};

typedef struct {
    int gpu;
    unsigned long long xid;
    unsigned long long after;
} fake_event;

typedef struct fake_event_set {
    int in_use;
    unsigned long long registered[MAX_GPUS];
    unsigned char delivered[MAX_EVENTS];
} *nvmlEventSet_t;

static struct fake_gpu gpus[MAX_GPUS];
static int n_gpus;
static fake_event events[MAX_EVENTS];
static int n_events;
static struct fake_event_set sets[MAX_SETS];
static char driver[TEXT];
static nvmlReturn_t init_error;
static int no_memory_v2;
static int init_refcount;
static char loaded_from[4096];
static int last_wait_timeout_ms = -1;

static const unsigned long long XID_CRITICAL_ERROR = 0x8;

/* ---- call counters, read by tests through fake_nvml_call_count ---- */

static const char *counted_names[] = {
    "nvmlInitWithFlags", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetTemperature", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetFieldValues", "nvmlEventSetCreate", "nvmlDeviceRegisterEvents",
    "nvmlDeviceGetSupportedEventTypes", "nvmlEventSetWait_v2", "nvmlEventSetFree",
};
#define N_COUNTED (sizeof(counted_names) / sizeof(counted_names[0]))
static unsigned long long call_counts[N_COUNTED];

static void count(const char *name) {
    for (size_t i = 0; i < N_COUNTED; i++) {
        if (strcmp(counted_names[i], name) == 0) {
            call_counts[i]++;
            return;
        }
    }
}

unsigned long long fake_nvml_call_count(const char *name) {
    for (size_t i = 0; i < N_COUNTED; i++) {
        if (strcmp(counted_names[i], name) == 0) return call_counts[i];
    }
    return 0;
}

int fake_nvml_last_wait_timeout_ms(void) { return last_wait_timeout_ms; }

/* ---- scenario parsing ---- */

static int scenario_error(const char *path, int line_no, const char *fmt, ...) {
    va_list args;
    fprintf(stderr, "fake libnvidia-ml: %s line %d: ", path, line_no);
    va_start(args, fmt);
    vfprintf(stderr, fmt, args);
    va_end(args);
    fputc('\n', stderr);
    return -1;
}

static void copy_text(char *dst, size_t size, const char *src) {
    snprintf(dst, size, "%s", src);
    size_t n = strlen(dst);
    while (n > 0 && (dst[n - 1] == '\n' || dst[n - 1] == '\r')) dst[--n] = '\0';
}

static void reset_state(void) {
    memset(gpus, 0, sizeof(gpus));
    memset(events, 0, sizeof(events));
    memset(sets, 0, sizeof(sets));
    memset(call_counts, 0, sizeof(call_counts));
    n_gpus = 0;
    n_events = 0;
    driver[0] = '\0';
    init_error = NVML_SUCCESS;
    no_memory_v2 = 0;
    last_wait_timeout_ms = -1;
}

static fake_field *field_slot(struct fake_gpu *g, unsigned int id) {
    for (int i = 0; i < g->n_fields; i++) {
        if (g->fields[i].id == id) return &g->fields[i];
    }
    if (g->n_fields == MAX_FIELDS) return NULL;
    fake_field *f = &g->fields[g->n_fields++];
    memset(f, 0, sizeof(*f));
    f->id = id;
    f->value_type = TYPE_ULONGLONG;
    return f;
}

static int parse_field(struct fake_gpu *g, const char *rest, const char *path, int line_no) {
    unsigned int id;
    unsigned long long value;
    int used = 0;
    if (sscanf(rest, "%u %llu%n", &id, &value, &used) != 2)
        return scenario_error(path, line_no, "expected 'field <id> <value> [type <t>] [step <n>]'");
    fake_field *f = field_slot(g, id);
    if (f == NULL) return scenario_error(path, line_no, "more than %d fields on one GPU", MAX_FIELDS);
    f->configured = 1;
    f->error = NVML_SUCCESS;
    f->value = value;
    const char *p = rest + used;
    char key[32];
    long long number;
    int more = 0;
    while (sscanf(p, " %31s %lld%n", key, &number, &more) == 2) {
        if (strcmp(key, "type") == 0 && number >= TYPE_DOUBLE && number <= TYPE_USHORT)
            f->value_type = (int)number;
        else if (strcmp(key, "step") == 0)
            f->step = number;
        else
            return scenario_error(path, line_no, "unknown field option '%s %lld'", key, number);
        p += more;
    }
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    if (*p != '\0') return scenario_error(path, line_no, "unexpected text '%s'", p);
    return 0;
}

static int parse_field_double(struct fake_gpu *g, const char *rest, const char *path, int line_no) {
    unsigned int id;
    char text[64];
    if (sscanf(rest, "%u %63s", &id, text) != 2)
        return scenario_error(path, line_no, "expected 'field_double <id> <number>'");
    fake_field *f = field_slot(g, id);
    if (f == NULL) return scenario_error(path, line_no, "more than %d fields on one GPU", MAX_FIELDS);
    f->configured = 1;
    f->error = NVML_SUCCESS;
    f->value_type = TYPE_DOUBLE;
    f->is_double = 1;
    f->dval = strtod(text, NULL);
    return 0;
}

static int parse_gpu_line(const char *body, const char *path, int line_no) {
    int index, used = 0;
    char key[32];
    if (sscanf(body, "%d %31s %n", &index, key, &used) != 2 || used == 0)
        return scenario_error(path, line_no, "expected 'gpu <index> <key> <value>'");
    if (index < 0 || index >= MAX_GPUS) return scenario_error(path, line_no, "GPU index %d out of range", index);
    struct fake_gpu *g = &gpus[index];
    if (!g->present) {
        g->present = 1;
        g->fail_after = -1;
        g->supported_events = XID_CRITICAL_ERROR;
    }
    if (index + 1 > n_gpus) n_gpus = index + 1;
    const char *rest = body + used;
    int ok = 1;
    if (strcmp(key, "name") == 0)
        copy_text(g->name, sizeof(g->name), rest);
    else if (strcmp(key, "uuid") == 0)
        copy_text(g->uuid, sizeof(g->uuid), rest);
    else if (strcmp(key, "pci") == 0)
        copy_text(g->pci, sizeof(g->pci), rest);
    else if (strcmp(key, "temp") == 0)
        ok = (g->has_temp = sscanf(rest, "%u", &g->temp) == 1);
    else if (strcmp(key, "util") == 0)
        ok = (g->has_util = sscanf(rest, "%u %u", &g->util_gpu, &g->util_mem) == 2);
    else if (strcmp(key, "clock_sm") == 0)
        ok = (g->has_clock_sm = sscanf(rest, "%u", &g->clock_sm) == 1);
    else if (strcmp(key, "clock_mem") == 0)
        ok = (g->has_clock_mem = sscanf(rest, "%u", &g->clock_mem) == 1);
    else if (strcmp(key, "memory") == 0)
        ok = (g->has_memory = sscanf(rest, "%llu %llu %llu", &g->mem_total, &g->mem_used, &g->mem_reserved) >= 2);
    else if (strcmp(key, "clock_event_reasons") == 0)
        ok = (g->has_reasons = sscanf(rest, "%llu", &g->reasons) == 1);
    else if (strcmp(key, "power_limit") == 0)
        ok = (g->has_power_limit = sscanf(rest, "%u", &g->power_limit_mw) == 1);
    else if (strcmp(key, "field") == 0)
        return parse_field(g, rest, path, line_no);
    else if (strcmp(key, "field_double") == 0)
        return parse_field_double(g, rest, path, line_no);
    else if (strcmp(key, "field_error") == 0) {
        unsigned int id;
        int code;
        if (sscanf(rest, "%u %d", &id, &code) != 2) return scenario_error(path, line_no, "expected 'field_error <id> <code>'");
        fake_field *f = field_slot(g, id);
        if (f == NULL) return scenario_error(path, line_no, "more than %d fields on one GPU", MAX_FIELDS);
        f->configured = 1;
        f->error = code;
    } else if (strcmp(key, "fail_after") == 0)
        ok = sscanf(rest, "%lld %d", &g->fail_after, &g->fail_code) == 2;
    else if (strcmp(key, "events") == 0)
        ok = sscanf(rest, "%llu", &g->supported_events) == 1;
    else
        return scenario_error(path, line_no, "unknown GPU key '%s'", key);
    if (!ok) return scenario_error(path, line_no, "bad value for '%s': '%s'", key, rest);
    return 0;
}

static int parse_line(char *line, const char *path, int line_no) {
    char *hash = strchr(line, '#');
    if (hash != NULL) *hash = '\0';
    char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    if (*p == '\0' || *p == '\n' || *p == '\r') return 0;
    if (strncmp(p, "driver ", 7) == 0) {
        copy_text(driver, sizeof(driver), p + 7);
        return 0;
    }
    if (strncmp(p, "init_error ", 11) == 0) {
        if (sscanf(p + 11, "%d", &init_error) != 1) return scenario_error(path, line_no, "expected 'init_error <code>'");
        return 0;
    }
    if (strncmp(p, "no_memory_v2", 12) == 0) {
        no_memory_v2 = 1;
        return 0;
    }
    if (strncmp(p, "gpu ", 4) == 0) return parse_gpu_line(p + 4, path, line_no);
    if (strncmp(p, "event ", 6) == 0) {
        if (n_events == MAX_EVENTS) return scenario_error(path, line_no, "more than %d events", MAX_EVENTS);
        fake_event *e = &events[n_events];
        if (sscanf(p + 6, "%d %llu %llu", &e->gpu, &e->xid, &e->after) != 3 || e->gpu < 0 || e->gpu >= MAX_GPUS)
            return scenario_error(path, line_no, "expected 'event <gpu> <xid> <after samples>'");
        n_events++;
        return 0;
    }
    return scenario_error(path, line_no, "unknown directive '%s'", p);
}

static nvmlReturn_t load_scenario(const char *path) {
    reset_state();
    FILE *file = fopen(path, "r");
    if (file == NULL) {
        fprintf(stderr, "fake libnvidia-ml: cannot open scenario %s\n", path);
        return NVML_ERROR_UNKNOWN;
    }
    char line[1024];
    int line_no = 0, failed = 0;
    while (!failed && fgets(line, sizeof(line), file) != NULL) failed = parse_line(line, path, ++line_no) != 0;
    fclose(file);
    for (int i = 0; !failed && i < n_gpus; i++) {
        if (!gpus[i].present) failed = scenario_error(path, 0, "GPU %d missing: indices must be contiguous", i) != 0;
    }
    return failed ? NVML_ERROR_UNKNOWN : NVML_SUCCESS;
}

/* ---- library state and device checks ---- */

/* `samples` counts samples started (field-value reads); the getters after a read belong to it.
 * fail_after N: the GPU answers through its first N samples, then fails; 0: it never answers. */
static int failing(const struct fake_gpu *g) {
    if (g->fail_after < 0) return 0;
    return g->fail_after == 0 || g->samples > (unsigned long long)g->fail_after;
}

static nvmlReturn_t device_state(nvmlDevice_t device) {
    if (init_refcount == 0) return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || device < gpus || device >= gpus + n_gpus) return NVML_ERROR_INVALID_ARGUMENT;
    return failing(device) ? device->fail_code : NVML_SUCCESS;
}

static nvmlReturn_t copy_out(char *dst, unsigned int length, const char *src) {
    if (dst == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* ---- exported NVML API ---- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    const char *path = getenv("FAKE_NVML_CONFIG");
    if (path == NULL) return NVML_ERROR_DRIVER_NOT_LOADED; /* no scenario: a host without a driver */
    if (init_refcount == 0 || strcmp(path, loaded_from) != 0) {
        nvmlReturn_t loaded = load_scenario(path);
        snprintf(loaded_from, sizeof(loaded_from), "%s", path);
        init_refcount = 0;
        if (loaded != NVML_SUCCESS) {
            loaded_from[0] = '\0';
            return loaded;
        }
    }
    count("nvmlInitWithFlags");
    if (init_error != NVML_SUCCESS) {
        nvmlReturn_t code = init_error;
        loaded_from[0] = '\0';
        return code;
    }
    init_refcount++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    count("nvmlShutdown");
    if (init_refcount == 0) return NVML_ERROR_UNINITIALIZED;
    init_refcount--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    count("nvmlSystemGetDriverVersion");
    if (init_refcount == 0) return NVML_ERROR_UNINITIALIZED;
    if (driver[0] == '\0') return NVML_ERROR_NOT_SUPPORTED;
    return copy_out(version, length, driver);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *device_count) {
    count("nvmlDeviceGetCount_v2");
    if (init_refcount == 0) return NVML_ERROR_UNINITIALIZED;
    if (device_count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *device_count = (unsigned int)n_gpus;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    count("nvmlDeviceGetHandleByIndex_v2");
    if (init_refcount == 0) return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= (unsigned int)n_gpus) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t state = device_state(&gpus[index]);
    if (state != NVML_SUCCESS) return state;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    count("nvmlDeviceGetName");
    nvmlReturn_t state = device_state(device);
    return state != NVML_SUCCESS ? state : copy_out(name, length, device->name);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    count("nvmlDeviceGetUUID");
    nvmlReturn_t state = device_state(device);
    return state != NVML_SUCCESS ? state : copy_out(uuid, length, device->uuid);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    count("nvmlDeviceGetPciInfo_v3");
    nvmlReturn_t state = device_state(device);
    if (state != NVML_SUCCESS) return state;
    if (pci == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof(*pci));
    memcpy(pci->busId, device->pci, sizeof(pci->busId));
    unsigned int domain = 0, bus = 0, dev = 0;
    if (sscanf(device->pci, "%x:%x:%x", &domain, &bus, &dev) == 3) {
        pci->domain = domain;
        pci->bus = bus;
        pci->device = dev;
    }
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04x:%02x:%02x.0", domain & 0xFFFF, bus & 0xFF, dev & 0xFF);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp) {
    count("nvmlDeviceGetTemperature");
    nvmlReturn_t state = device_state(device);
    if (state != NVML_SUCCESS) return state;
    if (temp == NULL || sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->has_temp) return NVML_ERROR_NOT_SUPPORTED;
    *temp = device->temp;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util) {
    count("nvmlDeviceGetUtilizationRates");
    nvmlReturn_t state = device_state(device);
    if (state != NVML_SUCCESS) return state;
    if (util == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->has_util) return NVML_ERROR_NOT_SUPPORTED;
    util->gpu = device->util_gpu;
    util->memory = device->util_mem;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock) {
    count("nvmlDeviceGetClockInfo");
    nvmlReturn_t state = device_state(device);
    if (state != NVML_SUCCESS) return state;
    if (clock == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (type == 1 && device->has_clock_sm) *clock = device->clock_sm;
    else if (type == 2 && device->has_clock_mem) *clock = device->clock_mem;
    else return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    count("nvmlDeviceGetMemoryInfo");
    nvmlReturn_t state = device_state(device);
    if (state != NVML_SUCCESS) return state;
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->has_memory) return NVML_ERROR_NOT_SUPPORTED;
    memory->total = device->mem_total;
    memory->used = device->mem_used + device->mem_reserved;
    memory->free = device->mem_total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    count("nvmlDeviceGetMemoryInfo_v2");
    if (no_memory_v2) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t state = device_state(device);
    if (state != NVML_SUCCESS) return state;
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (!device->has_memory) return NVML_ERROR_NOT_SUPPORTED;
    memory->total = device->mem_total;
    memory->reserved = device->mem_reserved;
    memory->used = device->mem_used;
    memory->free = device->mem_total - device->mem_used - device->mem_reserved;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons) {
    count("nvmlDeviceGetCurrentClocksEventReasons");
    nvmlReturn_t state = device_state(device);
    if (state != NVML_SUCCESS) return state;
    if (reasons == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->has_reasons) return NVML_ERROR_NOT_SUPPORTED;
    *reasons = device->reasons;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    count("nvmlDeviceGetEnforcedPowerLimit");
    nvmlReturn_t state = device_state(device);
    if (state != NVML_SUCCESS) return state;
    if (limit == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->has_power_limit) return NVML_ERROR_NOT_SUPPORTED;
    *limit = device->power_limit_mw;
    return NVML_SUCCESS;
}

static void store_value(nvmlFieldValue_t *out, int type, unsigned long long value) {
    out->valueType = type;
    switch (type) {
    case TYPE_DOUBLE: out->value.dVal = (double)value; break;
    case TYPE_UINT: out->value.uiVal = (unsigned int)value; break;
    case TYPE_ULONG: out->value.ulVal = (unsigned long)value; break;
    case TYPE_SLONGLONG: out->value.sllVal = (long long)value; break;
    case TYPE_SINT: out->value.siVal = (int)value; break;
    case TYPE_USHORT: out->value.usVal = (unsigned short)value; break;
    default: out->value.ullVal = value; break;
    }
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int values_count, nvmlFieldValue_t *values) {
    count("nvmlDeviceGetFieldValues");
    if (init_refcount > 0 && device >= gpus && device < gpus + n_gpus) device->samples++; /* a new sample starts */
    nvmlReturn_t state = device_state(device);
    if (state != NVML_SUCCESS) return state;
    if (values == NULL || values_count < 0) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long earlier = device->samples - 1;
    for (int i = 0; i < values_count; i++) {
        nvmlFieldValue_t *out = &values[i];
        out->timestamp = 0;
        out->latencyUsec = 0;
        out->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        for (int j = 0; j < device->n_fields; j++) {
            fake_field *f = &device->fields[j];
            if (f->id != out->fieldId || !f->configured) continue;
            out->nvmlReturn = f->error;
            if (f->error == NVML_SUCCESS && f->is_double) {
                out->valueType = TYPE_DOUBLE;
                out->value.dVal = f->dval;
            } else if (f->error == NVML_SUCCESS)
                store_value(out, f->value_type, f->value + (unsigned long long)(f->step * (long long)earlier));
            break;
        }
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    count("nvmlEventSetCreate");
    if (init_refcount == 0) return NVML_ERROR_UNINITIALIZED;
    if (set == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < MAX_SETS; i++) {
        if (!sets[i].in_use) {
            memset(&sets[i], 0, sizeof(sets[i]));
            sets[i].in_use = 1;
            *set = &sets[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_UNKNOWN;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types) {
    count("nvmlDeviceGetSupportedEventTypes");
    nvmlReturn_t state = device_state(device);
    if (state != NVML_SUCCESS) return state;
    if (types == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *types = device->supported_events;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set) {
    count("nvmlDeviceRegisterEvents");
    nvmlReturn_t state = device_state(device);
    if (state != NVML_SUCCESS) return state;
    if (set == NULL || !set->in_use) return NVML_ERROR_INVALID_ARGUMENT;
    if ((types & ~device->supported_events) != 0) return NVML_ERROR_NOT_SUPPORTED;
    set->registered[device - gpus] |= types;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms) {
    count("nvmlEventSetWait_v2");
    last_wait_timeout_ms = (int)timeout_ms;
    if (init_refcount == 0) return NVML_ERROR_UNINITIALIZED;
    if (set == NULL || !set->in_use || data == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < n_events; i++) {
        fake_event *e = &events[i];
        if (set->delivered[i] || e->gpu >= n_gpus) continue;
        if ((set->registered[e->gpu] & XID_CRITICAL_ERROR) == 0) continue;
        if (gpus[e->gpu].samples < e->after) continue;
        set->delivered[i] = 1;
        memset(data, 0, sizeof(*data));
        data->device = &gpus[e->gpu];
        data->eventType = XID_CRITICAL_ERROR;
        data->eventData = e->xid;
        return NVML_SUCCESS;
    }
    /* The real library would block up to timeout_ms; tests must never wait, so this returns at
     * once and records the timeout for fake_nvml_last_wait_timeout_ms. */
    return NVML_ERROR_TIMEOUT;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    count("nvmlEventSetFree");
    if (set == NULL || !set->in_use) return NVML_ERROR_INVALID_ARGUMENT;
    set->in_use = 0;
    return NVML_SUCCESS;
}
