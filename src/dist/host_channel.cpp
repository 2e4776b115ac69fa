#include "dist/host_channel.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace esplag {

namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Every message starts with a header; the magic number tells a stray connection from a rank.
constexpr uint32_t kMagic = 0x45535031;  // "ESP1"
enum Op : uint32_t {
  kHello = 1, kReady, kSumFloat, kSumDouble, kBroadcast, kBarrier, kAny, kAbort, kReduceScatter, kAllGather, kGather,
  kMaxFloat
};

// The elementwise collectives: every rank sends n values, rank 0 combines them in rank order.
bool elementwise(uint32_t op) { return op == kSumFloat || op == kSumDouble || op == kMaxFloat; }

const char* op_name(uint32_t op) {
  switch (op) {
    case kHello: case kReady: return "connect";
    case kSumFloat: return "all_reduce_sum(float)";
    case kSumDouble: return "all_reduce_sum(double)";
    case kBroadcast: return "broadcast";
    case kBarrier: return "barrier";
    case kAny: return "any";
    case kAbort: return "abort";
    case kReduceScatter: return "reduce_scatter_sum";
    case kAllGather: return "all_gather";
    case kGather: return "gather";
    case kMaxFloat: return "all_reduce_max(float)";
    default: return "an unknown message";
  }
}

struct Header {
  uint32_t magic = kMagic;
  uint32_t op = 0;
  uint64_t arg = 0;     // hello: the rank; broadcast: the root; reduce-scatter, gathers: the elements in all
  uint64_t length = 0;  // the payload's bytes (hello: the world size)
};

// A peer that failed: which rank and what happened, turned into the run's Error by the caller.
struct PeerFailure {
  int rank;
  std::string what;  // "left the run (connection closed)", "did not answer within 5 s"
  bool timed_out = false;
};

// A failure whose message is already the run's Error (from rank 0's abort, or a disagreement it found).
struct RunAborted {
  std::string message;
};

// Bytes read for a sum at a time by rank 0 (per rank, in rank order), so its memory stays small.
constexpr size_t kChunkBytes = size_t{4} << 20;

int poll_ms(double seconds) { return static_cast<int>(std::min(seconds * 1000.0, static_cast<double>(INT_MAX))); }

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

// Waits until `fd` is readable (POLLIN) or writable (POLLOUT); a PeerFailure after `timeout_s` without it.
void wait_for(int fd, short events, double timeout_s, int peer) {
  const auto deadline = after(timeout_s);
  for (;;) {
    const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, std::max(0, poll_ms(left)));
    if (r > 0) return;  // ready, or an error the next send/recv reports
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw PeerFailure{peer, std::string("could not be polled (") + std::strerror(errno) + ")"};
    if (left <= 0) throw PeerFailure{peer, "did not answer within " + seconds_text(timeout_s), true};
  }
}

std::string connection_error(int err) {
  return err == ECONNRESET || err == EPIPE ? "left the run (connection reset)"
                                           : std::string("left the run (") + std::strerror(err) + ")";
}

// Sends all `n` bytes; the timeout counts time without progress.
void send_all(int fd, const void* data, size_t n, double timeout_s, int peer) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    wait_for(fd, POLLOUT, timeout_s, peer);
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (k < 0) throw PeerFailure{peer, connection_error(errno)};
    p += k;
    n -= static_cast<size_t>(k);
  }
}

// Receives exactly `n` bytes; the timeout counts time without progress.
void recv_all(int fd, void* data, size_t n, double timeout_s, int peer) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    wait_for(fd, POLLIN, timeout_s, peer);
    const ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (k == 0) throw PeerFailure{peer, "left the run (connection closed)"};
    if (k < 0) throw PeerFailure{peer, connection_error(errno)};
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void send_frame(int fd, const Header& h, const void* payload, double timeout_s, int peer) {
  send_all(fd, &h, sizeof h, timeout_s, peer);
  send_all(fd, payload, h.length, timeout_s, peer);
}

Header recv_header(int fd, double timeout_s, int peer) {
  Header h;
  recv_all(fd, &h, sizeof h, timeout_s, peer);
  if (h.magic != kMagic) throw PeerFailure{peer, "sent a message that is not from esplag's host channel"};
  return h;
}

// Reads rank 0's abort message after `h` (its header); the Error every rank throws.
std::string recv_abort_message(int fd, const Header& h, double timeout_s) {
  std::string message(std::min<uint64_t>(h.length, 4096), '\0');
  recv_all(fd, message.data(), message.size(), timeout_s, 0);
  return message;
}

// Tries to read an abort message rank 0 sent before it closed the connection; empty if none.
std::string pending_abort(int fd) {
  try {
    const Header h = recv_header(fd, 0.5, 0);
    if (h.op == kAbort) return recv_abort_message(fd, h, 0.5);
  } catch (const PeerFailure&) {
  }
  return "";
}

void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

bool is_loopback(const std::string& addr) { return addr == "localhost" || addr.rfind("127.", 0) == 0; }

std::string endpoint(const std::string& addr, int port) { return addr + ":" + std::to_string(port); }

double timeout_from_env() {
  const char* v = std::getenv("ESPLAG_COLLECTIVE_TIMEOUT_S");
  if (!v) return 1800;
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  ESPLAG_CHECK(*v && *end == '\0' && std::isfinite(s) && s > 0, "ESPLAG_COLLECTIVE_TIMEOUT_S='", v,
               "' is not a number of seconds > 0");
  return s;
}

// Sends the abort message to each socket (best effort: a peer that is gone does not read it) and closes them.
void abort_peers(std::vector<int>& sockets, const std::string& message) {
  Header h;
  h.op = kAbort;
  h.length = message.size();
  for (int& fd : sockets) {
    if (fd < 0) continue;
    try {
      send_frame(fd, h, message.data(), 0.5, -1);
    } catch (const PeerFailure&) {
    }
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
    fd = -1;
  }
}

// Rank 0's listening socket on the master port.
int listen_on(const World& w) {
  const std::string where = endpoint(is_loopback(w.master_addr) ? "127.0.0.1" : "0.0.0.0", w.master_port);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ESPLAG_CHECK(fd >= 0, "rank 0 cannot create a socket to listen on ", where, ": ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(w.master_port));
  a.sin_addr.s_addr = htonl(is_loopback(w.master_addr) ? INADDR_LOOPBACK : INADDR_ANY);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, w.size) != 0) {
    const int err = errno;
    ::close(fd);
    fail("rank 0 cannot listen on ", where, " (MASTER_ADDR=", w.master_addr, ", MASTER_PORT=", w.master_port, "): ",
         std::strerror(err), err == EADDRINUSE ? "; another run may be using this port: choose another MASTER_PORT" : "");
  }
  return fd;
}

// Rank 0: accepts one connection per other rank, each introducing itself, until `deadline`.
std::vector<int> accept_ranks(const World& w, int listener, Clock::time_point deadline) {
  std::vector<int> sockets(w.size, -1);
  int arrived = 1;
  try {
    while (arrived < w.size) {
      const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
      pollfd p{listener, POLLIN, 0};
      const int r = left > 0 ? ::poll(&p, 1, poll_ms(left)) : 0;
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        std::string missing;
        for (int i = 1; i < w.size; ++i)
          if (sockets[i] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(i);
        fail("rank 0 listening on ", endpoint(w.master_addr, w.master_port), ": only ", arrived, " of ", w.size,
             " ranks arrived within the connect timeout (missing: rank ", missing, ")");
      }
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      set_nodelay(fd);
      Header h;
      try {
        h = recv_header(fd, std::clamp(left, 0.1, 10.0), -1);  // a rank says hello at once
      } catch (const PeerFailure&) {
        ::close(fd);  // not a rank of this run (a port scan, a stray client)
        continue;
      }
      const int rank = static_cast<int>(h.arg);
      if (h.op != kHello || h.length != static_cast<uint64_t>(w.size) || rank < 1 || rank >= w.size ||
          sockets[rank] >= 0) {
        ::close(fd);
        fail("rank 0 on ", endpoint(w.master_addr, w.master_port), ": a process introducing itself as rank ", rank,
             " of ", h.length, " connected, but this run has ", w.size, " ranks",
             rank >= 1 && rank < w.size && sockets[rank] >= 0 ? " and rank " + std::to_string(rank) + " is already there"
                                                              : "",
             "; is another run using MASTER_PORT=", w.master_port, "?");
      }
      sockets[rank] = fd;
      ++arrived;
    }
  } catch (const Error& e) {
    abort_peers(sockets, e.what());
    throw;
  }
  return sockets;
}

// One attempt to open a TCP connection to addr:port before `deadline`; -1 with `error` set when it failed.
int try_connect(const std::string& addr, int port, Clock::time_point deadline, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int gai = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (gai != 0) {
    error = std::string("cannot resolve the address: ") + ::gai_strerror(gai);
    return -1;
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int err = fd < 0 ? errno : 0;
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
      pollfd p{fd, POLLOUT, 0};
      err = ::poll(&p, 1, std::max(1, poll_ms(std::min(left, 5.0)))) > 0 ? 0 : ETIMEDOUT;
      socklen_t len = sizeof err;
      if (err == 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    }
  }
  ::freeaddrinfo(found);
  if (err != 0) {
    if (fd >= 0) ::close(fd);
    error = std::strerror(err);
    return -1;
  }
  set_nodelay(fd);
  return fd;
}

// A rank other than 0: connects to rank 0, introduces itself and waits until every rank is there.
int join_rank0(const World& w, double timeout_s) {
  const auto deadline = after(timeout_s);
  const std::string where = endpoint(w.master_addr, w.master_port);
  std::string error;
  int fd = -1;
  while ((fd = try_connect(w.master_addr, w.master_port, deadline, error)) < 0) {
    ESPLAG_CHECK(Clock::now() < deadline, "rank ", w.rank, " could not connect to rank 0 at ", where, " within ",
                 seconds_text(timeout_s), " (", error, "); rank 0 must be running, with MASTER_ADDR an address of "
                 "its node and the same MASTER_PORT");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  Header hello;
  hello.op = kHello;
  hello.arg = static_cast<uint64_t>(w.rank);
  hello.length = static_cast<uint64_t>(w.size);
  try {
    send_all(fd, &hello, sizeof hello, timeout_s, 0);
    const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    const Header h = recv_header(fd, std::max(0.1, left), 0);
    if (h.op == kAbort) throw RunAborted{recv_abort_message(fd, h, 1.0)};
    if (h.op != kReady) throw PeerFailure{0, "answered with " + std::string(op_name(h.op))};
  } catch (const PeerFailure& f) {
    ::close(fd);
    fail("rank ", w.rank, " connected to rank 0 at ", where, ", but not all ", w.size, " ranks arrived: rank 0 ",
         f.what);
  } catch (const RunAborted& a) {
    ::close(fd);
    fail(a.message);
  }
  return fd;
}

// Rank 0: reads every other rank's header and checks it is the same collective as `mine`
// (same op; same size for a sum, same root for a broadcast).
std::vector<Header> gather_headers(const std::vector<int>& sockets, const Header& mine, double timeout_s) {
  std::vector<Header> headers(sockets.size());
  headers[0] = mine;
  for (size_t r = 1; r < sockets.size(); ++r) {
    const Header h = recv_header(sockets[r], timeout_s, static_cast<int>(r));
    const std::string who = "rank " + std::to_string(r);
    if (h.op != mine.op)
      throw RunAborted{"the ranks called different collectives: rank 0 " + std::string(op_name(mine.op)) + ", " + who +
                       " " + op_name(h.op)};
    if (elementwise(mine.op) && h.length != mine.length)
      throw RunAborted{std::string(op_name(mine.op)) + " of different sizes: " + std::to_string(mine.length) +
                       " bytes on rank 0, " + std::to_string(h.length) + " on " + who};
    if ((mine.op == kReduceScatter || mine.op == kAllGather || mine.op == kGather) && h.arg != mine.arg)
      throw RunAborted{std::string(op_name(mine.op)) + " of different sizes: " + std::to_string(mine.arg) +
                       " elements in all on rank 0, " + std::to_string(h.arg) + " on " + who};
    if (mine.op == kBroadcast && h.arg != mine.arg)
      throw RunAborted{"broadcast from different roots: rank " + std::to_string(mine.arg) + " on rank 0, rank " +
                       std::to_string(h.arg) + " on " + who};
    headers[r] = h;
  }
  return headers;
}

// A rank other than 0: rank 0's reply to a collective of `op` (an abort becomes RunAborted).
Header recv_reply(int fd, uint32_t op, double timeout_s) {
  const Header h = recv_header(fd, timeout_s, 0);
  if (h.op == kAbort) throw RunAborted{recv_abort_message(fd, h, 1.0)};
  if (h.op != op) throw PeerFailure{0, "answered " + std::string(op_name(op)) + " with " + op_name(h.op)};
  return h;
}

}  // namespace

std::unique_ptr<HostChannel> HostChannel::connect(const World& world, double timeout_s) {
  ESPLAG_CHECK(timeout_s > 0, "the host channel's connect timeout must be > 0 s, got ", timeout_s);
  const double collective_timeout = timeout_from_env();
  std::vector<int> sockets;
  if (world.size > 1 && world.rank == 0) {
    const auto deadline = after(timeout_s);
    const int listener = listen_on(world);
    try {
      sockets = accept_ranks(world, listener, deadline);
    } catch (...) {
      ::close(listener);
      throw;
    }
    ::close(listener);
    Header ready;
    ready.op = kReady;
    for (int r = 1; r < world.size; ++r) {
      try {
        send_all(sockets[r], &ready, sizeof ready, timeout_s, r);
      } catch (const PeerFailure& f) {
        const std::string message = "rank " + std::to_string(r) + " " + f.what + " while connecting";
        abort_peers(sockets, message);
        fail(message);
      }
    }
  } else if (world.size > 1) {
    sockets.push_back(join_rank0(world, timeout_s));
  }
  return std::unique_ptr<HostChannel>(new HostChannel(world.rank, world.size, std::move(sockets), collective_timeout));
}

HostChannel::HostChannel(int rank, int size, std::vector<int> sockets, double timeout_s)
    : rank_(rank), size_(size), sockets_(std::move(sockets)), timeout_s_(timeout_s) {}

HostChannel::~HostChannel() {
  for (int fd : sockets_)
    if (fd >= 0) ::close(fd);
}

void HostChannel::set_timeout(double seconds) {
  ESPLAG_CHECK(std::isfinite(seconds) && seconds > 0, "the collective timeout must be a number of seconds > 0, got ",
               seconds);
  timeout_s_ = seconds;
}

void HostChannel::abort_run(const std::string& message) {
  failure_ = message;
  if (rank_ == 0) {
    abort_peers(sockets_, message);
  } else {
    for (int& fd : sockets_) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  }
  fail(message);
}

template <typename Exchange>
void HostChannel::guarded(const char* name, const Exchange& exchange) {
  if (!failure_.empty()) fail(failure_, " (an earlier collective failed)");
  if (size_ == 1) return;
  try {
    exchange();
  } catch (const RunAborted& a) {
    abort_run(a.message);
  } catch (const PeerFailure& f) {
    // Rank 0 may have said why it closed the connection before this rank noticed.
    const std::string reason = rank_ == 0 ? "" : pending_abort(sockets_[0]);
    if (!reason.empty()) abort_run(reason);
    abort_run("rank " + std::to_string(f.rank) + " " + f.what + " during " + name +
              (f.timed_out ? " (the collective timeout, ESPLAG_COLLECTIVE_TIMEOUT_S)" : ""));
  }
}

template <typename T>
void HostChannel::reduce(T* data, size_t n, bool max, const char* name) {
  ESPLAG_CHECK(!max || sizeof(T) == sizeof(float), "HostChannel: all_reduce_max takes floats");
  Header mine;
  mine.op = max ? kMaxFloat : sizeof(T) == sizeof(float) ? kSumFloat : kSumDouble;
  mine.length = n * sizeof(T);
  guarded(name, [&] {
    if (rank_ != 0) {
      // Others wait a little longer for the reply, so that rank 0's message naming a late rank reaches them first.
      send_frame(sockets_[0], mine, data, timeout_s_, 0);
      recv_reply(sockets_[0], mine.op, timeout_s_ * 1.1 + 1);
      recv_all(sockets_[0], data, mine.length, timeout_s_, 0);
      return;
    }
    gather_headers(sockets_, mine, timeout_s_);
    // Chunk by chunk, each rank's values combined in rank order: every sum is ((r0 + r1) + r2) ...
    const size_t chunk = std::max<size_t>(1, kChunkBytes / sizeof(T));
    std::vector<T> peer(std::min(n, chunk));
    for (size_t first = 0; first < n; first += chunk) {
      const size_t count = std::min(chunk, n - first);
      for (int r = 1; r < size_; ++r) {
        recv_all(sockets_[r], peer.data(), count * sizeof(T), timeout_s_, r);
        for (size_t i = 0; i < count; ++i)
          data[first + i] = max ? std::max(data[first + i], peer[i]) : data[first + i] + peer[i];
      }
    }
    for (int r = 1; r < size_; ++r) send_frame(sockets_[r], mine, data, timeout_s_, r);
  });
}

void HostChannel::all_reduce_sum(float* data, size_t n) { reduce(data, n, false, "all_reduce_sum"); }
void HostChannel::all_reduce_sum(double* data, size_t n) { reduce(data, n, false, "all_reduce_sum"); }
void HostChannel::all_reduce_max(float* data, size_t n) { reduce(data, n, true, "all_reduce_max"); }

namespace {

// Checks a collective's per-rank counts: one per rank; their sum, the elements in all.
size_t checked_total(const std::vector<size_t>& counts, int size, const char* name) {
  ESPLAG_CHECK(counts.size() == static_cast<size_t>(size), name, ": ", counts.size(), " counts for a run of ", size,
               " ranks");
  size_t total = 0;
  for (size_t c : counts) total += c;
  return total;
}

}  // namespace

void HostChannel::reduce_scatter_sum(const float* data, const std::vector<size_t>& counts, float* out) {
  const size_t total = checked_total(counts, size_, "reduce_scatter_sum");
  std::vector<size_t> offsets(size_ + 1, 0);
  for (int r = 0; r < size_; ++r) offsets[r + 1] = offsets[r] + counts[r];
  if (size_ == 1 && failure_.empty()) std::copy(data, data + total, out);
  Header mine;
  mine.op = kReduceScatter;
  mine.arg = total;
  mine.length = total * sizeof(float);
  guarded("reduce_scatter_sum", [&] {
    if (rank_ != 0) {
      // The ranges up to this rank's, its sum back, then the rest: rank 0 finishes a range once
      // every rank has sent it, and sends it while its owner waits for it (no rank sends into a
      // peer that is sending too).
      const size_t until = offsets[rank_ + 1];
      send_all(sockets_[0], &mine, sizeof mine, timeout_s_, 0);
      send_all(sockets_[0], data, until * sizeof(float), timeout_s_, 0);
      const Header reply = recv_reply(sockets_[0], kReduceScatter, timeout_s_ * 1.1 + 1);
      if (reply.length != counts[rank_] * sizeof(float))
        throw PeerFailure{0, "answered reduce_scatter_sum with " + std::to_string(reply.length) + " bytes"};
      recv_all(sockets_[0], out, reply.length, timeout_s_, 0);
      send_all(sockets_[0], data + until, (total - until) * sizeof(float), timeout_s_, 0);
      return;
    }
    gather_headers(sockets_, mine, timeout_s_);
    // Range by range, chunk by chunk, each rank's values added in rank order: ((r0 + r1) + r2) ...
    const size_t chunk = kChunkBytes / sizeof(float);
    std::vector<float> peer, range;
    for (int owner = 0; owner < size_; ++owner) {
      float* sum = owner == 0 ? out : (range.resize(counts[owner]), range.data());
      std::copy(data + offsets[owner], data + offsets[owner + 1], sum);
      for (size_t first = 0; first < counts[owner]; first += chunk) {
        const size_t count = std::min(chunk, counts[owner] - first);
        peer.resize(count);
        for (int r = 1; r < size_; ++r) {
          recv_all(sockets_[r], peer.data(), count * sizeof(float), timeout_s_, r);
          for (size_t i = 0; i < count; ++i) sum[first + i] += peer[i];
        }
      }
      if (owner == 0) continue;
      Header reply = mine;
      reply.length = counts[owner] * sizeof(float);
      send_frame(sockets_[owner], reply, sum, timeout_s_, owner);
    }
  });
}

void HostChannel::gather_to(const float* mine_data, const std::vector<size_t>& counts, float* out, bool to_all) {
  const char* name = to_all ? "all_gather" : "gather";
  const size_t total = checked_total(counts, size_, name);
  if (size_ == 1 && failure_.empty()) std::copy(mine_data, mine_data + total, out);
  Header mine;
  mine.op = to_all ? kAllGather : kGather;
  mine.arg = total;
  mine.length = counts[rank_] * sizeof(float);
  guarded(name, [&] {
    if (rank_ != 0) {
      send_frame(sockets_[0], mine, mine_data, timeout_s_, 0);
      const Header reply = recv_reply(sockets_[0], mine.op, timeout_s_ * 1.1 + 1);
      if (reply.length != (to_all ? total * sizeof(float) : 0))
        throw PeerFailure{0, "answered " + std::string(name) + " with " + std::to_string(reply.length) + " bytes"};
      if (to_all) recv_all(sockets_[0], out, reply.length, timeout_s_, 0);
      return;
    }
    const std::vector<Header> headers = gather_headers(sockets_, mine, timeout_s_);
    for (int r = 1; r < size_; ++r)
      if (headers[r].length != counts[r] * sizeof(float))
        throw RunAborted{std::string(name) + ": rank " + std::to_string(r) + " sent " +
                         std::to_string(headers[r].length / sizeof(float)) + " elements, rank 0 expected " +
                         std::to_string(counts[r])};
    float* at = std::copy(mine_data, mine_data + counts[0], out);
    for (int r = 1; r < size_; ++r) {
      recv_all(sockets_[r], at, counts[r] * sizeof(float), timeout_s_, r);
      at += counts[r];
    }
    Header reply = mine;
    reply.length = to_all ? total * sizeof(float) : 0;
    for (int r = 1; r < size_; ++r) send_frame(sockets_[r], reply, out, timeout_s_, r);
  });
}

void HostChannel::all_gather(const float* mine, const std::vector<size_t>& counts, float* out) {
  gather_to(mine, counts, out, true);
}

void HostChannel::gather(const float* mine, const std::vector<size_t>& counts, float* out) {
  gather_to(mine, counts, out, false);
}

void HostChannel::broadcast(std::string& bytes, int root) {
  ESPLAG_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of this run of ", size_);
  Header mine;
  mine.op = kBroadcast;
  mine.arg = static_cast<uint64_t>(root);
  mine.length = rank_ == root ? bytes.size() : 0;
  guarded("broadcast", [&] {
    if (rank_ != 0) {
      send_frame(sockets_[0], mine, bytes.data(), timeout_s_, 0);
      const Header reply = recv_reply(sockets_[0], kBroadcast, timeout_s_ * 1.1 + 1);
      if (rank_ == root) return;
      bytes.resize(reply.length);
      recv_all(sockets_[0], bytes.data(), bytes.size(), timeout_s_, 0);
      return;
    }
    const std::vector<Header> headers = gather_headers(sockets_, mine, timeout_s_);
    // Only the root's message has bytes.
    if (root != 0) {
      bytes.resize(headers[root].length);
      recv_all(sockets_[root], bytes.data(), bytes.size(), timeout_s_, root);
    }
    Header reply = mine;
    for (int r = 1; r < size_; ++r) {
      reply.length = r == root ? 0 : bytes.size();
      send_frame(sockets_[r], reply, bytes.data(), timeout_s_, r);
    }
  });
}

bool HostChannel::any(bool flag) {
  Header mine;
  mine.op = kAny;
  mine.arg = flag ? 1 : 0;
  bool result = flag;
  guarded("any", [&] {
    if (rank_ != 0) {
      send_frame(sockets_[0], mine, nullptr, timeout_s_, 0);
      result = recv_reply(sockets_[0], kAny, timeout_s_ * 1.1 + 1).arg != 0;
      return;
    }
    for (const Header& h : gather_headers(sockets_, mine, timeout_s_)) result = result || h.arg != 0;
    Header reply = mine;
    reply.arg = result ? 1 : 0;
    for (int r = 1; r < size_; ++r) send_frame(sockets_[r], reply, nullptr, timeout_s_, r);
  });
  return result;
}

void HostChannel::barrier() {
  Header mine;
  mine.op = kBarrier;
  guarded("barrier", [&] {
    if (rank_ != 0) {
      send_frame(sockets_[0], mine, nullptr, timeout_s_, 0);
      recv_reply(sockets_[0], kBarrier, timeout_s_ * 1.1 + 1);
      return;
    }
    gather_headers(sockets_, mine, timeout_s_);
    for (int r = 1; r < size_; ++r) send_frame(sockets_[r], mine, nullptr, timeout_s_, r);
  });
}

}  // namespace esplag
