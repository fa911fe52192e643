
// rpcfleet hash-manifest patch: a weight tensor's hash from the manifest rpcfleet wrote for its file
// ($GGML_RPC_HASH_MANIFESTS/<st_dev>-<st_ino>.fnv) instead of hashing its bytes, when the tensor's data
// lies in a read-only file mapping of this process and the file is the one the manifest was made of
// (device, inode, size, mtime, ctime) with an entry at exactly that offset and size. Anything else is
// hashed as stock does. $GGML_RPC_HASH_LOG names a file that gets one line per weight tensor hashed or
// looked up (how the tests and the benchmark count them).
#if defined(__linux__)
#include <sys/stat.h>
#include <sys/sysmacros.h>
#endif
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
namespace rpcfleet_manifest {

struct file_identity {
    uint64_t dev = 0, ino = 0, size = 0;
    int64_t mtime_ns = 0, ctime_ns = 0;
    bool operator==(const file_identity & o) const {
        return dev == o.dev && ino == o.ino && size == o.size && mtime_ns == o.mtime_ns && ctime_ns == o.ctime_ns;
    }
};

struct manifest {
    file_identity checked_for;    // the file's identity when this entry was (re)read
    bool matches = false;         // the manifest exists and was written for exactly that identity
    int64_t manifest_mtime_ns = -1;
    uint64_t manifest_size = 0;
    std::unordered_map<uint64_t, std::pair<uint64_t, uint64_t>> entries;  // offset -> (size, hash)
};

static std::mutex lock;
static std::map<std::pair<uint64_t, uint64_t>, manifest> manifests;

#if defined(__linux__)
static file_identity identity_of(const struct stat & st) {
    file_identity id;
    id.dev = (uint64_t) st.st_dev;
    id.ino = (uint64_t) st.st_ino;
    id.size = (uint64_t) st.st_size;
    id.mtime_ns = (int64_t) st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    id.ctime_ns = (int64_t) st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
    return id;
}

// The file mapping holding [data, data + size), read afresh from /proc/self/maps (a range unmapped and
// mapped again to another file must never keep its old file): its path and the data's file offset.
static bool find_mapping(const void * data, size_t size, std::string & path, uint64_t & file_offset,
                         unsigned & major_no, unsigned & minor_no, uint64_t & ino) {
    FILE * maps = fopen("/proc/self/maps", "re");
    if (!maps) {
        return false;
    }
    const uintptr_t begin = (uintptr_t) data;
    bool found = false;
    char line[4352];
    while (!found && fgets(line, sizeof(line), maps)) {
        unsigned long long start, end, offset, inode;
        unsigned maj, min;
        char perms[8];
        int path_at = 0;
        if (sscanf(line, "%llx-%llx %7s %llx %x:%x %llu %n", &start, &end, perms, &offset, &maj, &min, &inode, &path_at) < 7) {
            continue;
        }
        if (begin < start || begin >= end) {
            continue;
        }
        // the whole tensor in this one mapping, which this process cannot have written (read-only)
        if (inode == 0 || perms[0] != 'r' || perms[1] == 'w' || size > end - begin || path_at <= 0 || line[path_at] != '/') {
            break;
        }
        std::string p(line + path_at);
        while (!p.empty() && (p.back() == '\n' || p.back() == '\r')) {
            p.pop_back();
        }
        path = p;
        file_offset = offset + (begin - start);
        major_no = maj;
        minor_no = min;
        ino = inode;
        found = true;
    }
    fclose(maps);
    return found;
}

static void read_manifest(const std::string & file, manifest & m) {
    m.entries.clear();
    m.matches = false;
    struct stat st;
    if (stat(file.c_str(), &st) != 0) {
        m.manifest_mtime_ns = -1;
        return;
    }
    m.manifest_mtime_ns = (int64_t) st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    m.manifest_size = (uint64_t) st.st_size;
    FILE * in = fopen(file.c_str(), "re");
    if (!in) {
        return;
    }
    char magic[64] = {0};
    int version = 0;
    unsigned long long dev, ino, fsize;
    long long mtime_ns, ctime_ns;
    if (fscanf(in, "%63s %d", magic, &version) == 2 && strcmp(magic, "rpcfleet-fnv-manifest") == 0 && version == 1 &&
        fscanf(in, " dev %llu ino %llu size %llu mtime_ns %lld ctime_ns %lld", &dev, &ino, &fsize, &mtime_ns, &ctime_ns) == 5) {
        file_identity id;
        id.dev = dev; id.ino = ino; id.size = fsize; id.mtime_ns = mtime_ns; id.ctime_ns = ctime_ns;
        unsigned long long offset, size, hash;
        bool complete = false;
        while (true) {
            int got = fscanf(in, " %llu %llu %llx", &offset, &size, &hash);
            if (got == 3) {
                m.entries[offset] = {size, hash};
                continue;
            }
            char end_mark[16] = {0};
            complete = got == 0 && fscanf(in, "%15s", end_mark) == 1 && strcmp(end_mark, "end") == 0;
            break;
        }
        // a manifest cut short (no `end`) is no manifest
        m.matches = complete && id == m.checked_for;
    }
    fclose(in);
    if (!m.matches) {
        m.entries.clear();
    }
}

// The manifest's hash of [data, data + size), or false with the reason it must be hashed.
static bool lookup(const void * data, size_t size, uint64_t & hash, const char *& why) {
    const char * dir = std::getenv("GGML_RPC_HASH_MANIFESTS");
    if (!dir || !*dir) {
        why = "no-manifests-dir";
        return false;
    }
    std::string path;
    uint64_t offset = 0, ino = 0;
    unsigned maj = 0, min = 0;
    if (!find_mapping(data, size, path, offset, maj, min, ino)) {
        why = "not-mapped";
        return false;
    }
    struct stat st;
    // the path must still name the mapped file (not one renamed over it, nor a deleted one)
    if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t) st.st_ino != ino ||
        major(st.st_dev) != maj || minor(st.st_dev) != min) {
        why = "not-the-mapped-file";
        return false;
    }
    const file_identity now = identity_of(st);
    const std::string file = std::string(dir) + "/" + std::to_string(now.dev) + "-" + std::to_string(now.ino) + ".fnv";
    std::lock_guard<std::mutex> guard(lock);
    manifest & m = manifests[{now.dev, now.ino}];
    if (!(m.checked_for == now)) {
        m.checked_for = now;
        read_manifest(file, m);
    }
    auto it = m.entries.find(offset);
    if (it == m.entries.end()) {
        // the manifest may have grown since it was read (a warm names more tensors): read it again if it changed
        struct stat ms;
        if (stat(file.c_str(), &ms) == 0 &&
            ((int64_t) ms.st_mtim.tv_sec * 1000000000LL + ms.st_mtim.tv_nsec != m.manifest_mtime_ns || (uint64_t) ms.st_size != m.manifest_size)) {
            read_manifest(file, m);
            it = m.entries.find(offset);
        }
    }
    if (m.manifest_mtime_ns < 0) {
        why = "no-manifest";
        return false;
    }
    if (!m.matches) {
        why = "file-changed";
        return false;
    }
    if (it == m.entries.end() || it->second.first != size) {
        why = "no-entry";
        return false;
    }
    hash = it->second.second;
    why = "exact";
    return true;
}
#else
static bool lookup(const void *, size_t, uint64_t &, const char *& why) {
    why = "not-linux";
    return false;
}
#endif

static void note(const char * how, const char * why, size_t size, uint64_t hash) {
    const char * log = std::getenv("GGML_RPC_HASH_LOG");
    if (!log || !*log) {
        return;
    }
    std::lock_guard<std::mutex> guard(lock);
    if (FILE * out = fopen(log, "ae")) {
        fprintf(out, "%s %s %zu %016" PRIx64 "\n", how, why, size, hash);
        fclose(out);
    }
}

}  // namespace rpcfleet_manifest
