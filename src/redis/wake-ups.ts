import { Injectable, Logger, OnApplicationShutdown } from '@nestjs/common';
import { Redis } from 'ioredis';
import { AppConfig } from '../config/app-config.js';
import { poolBase } from './keys.js';
import { reconnectDelay, warnEachError, withTimeout } from './redis.client.js';

/** Items that came free in a pool: their values and attributes, or (more than 32 at once) only how many. */
export interface FreedItems {
  count: number;
  items?: { v: string; a?: Record<string, string> }[];
}

export interface FreedListener {
  /** Items came free in the pool. */
  freed(freed: FreedItems): void;
  /** A waiter for `count` items left the waiting line `line` with its place live: items may have been kept for it. */
  left(line: string, count: number): void;
  /** The connection was lost: messages may be missed until `live` says true again. */
  lost(): void;
}

/** The channel the scripts that free items of a pool publish on (_lib.lua, wake_waiters). */
export function freedChannel(prefix: string, pool: string): string {
  return `${poolBase(prefix, pool)}freed`;
}

/** A message of wake_waiters: a JSON array of {v, a} or a count; null if it is neither. */
export function parseFreed(message: string): FreedItems | null {
  if (/^\d+$/.test(message)) return Number(message) > 0 ? { count: Number(message) } : null;
  try {
    const items: unknown = JSON.parse(message);
    if (!Array.isArray(items) || items.length === 0) return null;
    const listed: { v: string; a?: Record<string, string> }[] = [];
    for (const item of items) {
      if (typeof item !== 'object' || item === null || typeof (item as { v?: unknown }).v !== 'string') return null;
      const { v, a } = item as { v: string; a?: unknown };
      // cjson writes an empty attribute table as {} and a missing one not at all.
      listed.push(typeof a === 'object' && a !== null && !Array.isArray(a) ? { v, a: a as Record<string, string> } : { v });
    }
    return { count: listed.length, items: listed };
  } catch {
    return null;
  }
}

/** A message of HoldStore.leaveLine, `left <line> <count>`: the line and the count; null if it is not one. */
export function parseLeft(message: string): { line: string; count: number } | null {
  const match = /^left (\S+) (\d+)$/.exec(message);
  return match && Number(match[2]) > 0 ? { line: match[1], count: Number(match[2]) } : null;
}

/** How often the connection is checked while anyone listens (PING): a link that died silently is dropped. */
const KEEPALIVE_MS = 1_000;

/**
 * The connection that hears of items coming free, for the reserves that wait (waitMs). The scripts that put items
 * back in a pool's free index publish them on its channel while a reserve waits in that pool (`<base>ww`,
 * reserve.lua), and so does a waiter that leaves its line while items may be kept for it (HoldStore.leaveLine); this
 * instance subscribes to the channels of the pools its waiters wait in, on a connection of its
 * own (a subscribed connection can send nothing else), opened when the first waiter listens. While anyone listens
 * it PINGs the connection every second and drops it (to reconnect) when no answer comes within REDIS_TIMEOUT_MS,
 * so a link that died without a word is not taken for a quiet one for long.
 *
 * A message can be lost: published while the connection is down, or between a waiter's try and its subscription.
 * That costs speed only: a waiter also tries again on its own (ReservationsService), and `live` tells it when it
 * cannot count on being woken.
 */
@Injectable()
export class WakeUps implements OnApplicationShutdown {
  private readonly logger = new Logger(WakeUps.name);
  private connection?: Redis;
  /** Listeners by channel, in the order they began to listen. */
  private readonly listeners = new Map<string, Set<FreedListener>>();
  /** Channels Redis has confirmed this connection's subscription to, since it last connected. */
  private readonly confirmed = new Set<string>();
  private keepalive?: NodeJS.Timeout;
  private closed = false;

  constructor(private readonly config: AppConfig) {}

  /** Tells `listener` each time items come free in `pool`, until the function returned is called. */
  listen(pool: string, listener: FreedListener): () => void {
    if (this.config.WAIT_WAKE_UPS === 'false') return () => undefined;
    const channel = freedChannel(this.config.REDIS_KEY_PREFIX, pool);
    let set = this.listeners.get(channel);
    if (!set) {
      set = new Set();
      this.listeners.set(channel, set);
      this.subscribe(channel);
    }
    set.add(listener);
    return () => {
      const now = this.listeners.get(channel);
      if (!now?.delete(listener) || now.size > 0) return;
      this.listeners.delete(channel);
      this.confirmed.delete(channel);
      if (this.connection?.status === 'ready') this.connection.unsubscribe(channel).catch(() => undefined);
    };
  }

  /** Whether a listener of this pool is told when its items come free: subscribed, and connected since. */
  live(pool: string): boolean {
    return this.connection?.status === 'ready' && this.confirmed.has(freedChannel(this.config.REDIS_KEY_PREFIX, pool));
  }

  private subscribe(channel: string): void {
    if (this.closed) return;
    const connection = this.open();
    // Sent now if connected, else on the next 'ready' (below): never queued, so never sent twice.
    if (connection.status !== 'ready') return;
    connection.subscribe(channel).then(
      () => {
        if (this.listeners.has(channel)) this.confirmed.add(channel);
      },
      () => undefined,
    );
  }

  private open(): Redis {
    if (this.connection) return this.connection;
    const connection = new Redis(this.config.REDIS_URL, {
      lazyConnect: true,
      enableOfflineQueue: false,
      // Subscriptions are made again on each 'ready', for the channels listened to then (the set changes meanwhile).
      autoResubscribe: false,
      autoResendUnfulfilledCommands: false,
      maxRetriesPerRequest: 1,
      connectTimeout: this.config.REDIS_TIMEOUT_MS,
      retryStrategy: reconnectDelay,
    });
    warnEachError(connection, (message) => this.logger.warn(`redis (waiters' wake-ups): ${message}`));
    connection.on('close', () => {
      this.confirmed.clear();
      for (const set of this.listeners.values()) for (const listener of [...set]) listener.lost();
    });
    connection.on('ready', () => {
      this.confirmed.clear();
      for (const channel of this.listeners.keys()) this.subscribe(channel);
    });
    connection.on('message', (channel: string, message: string) => {
      const set = this.listeners.get(channel);
      if (!set) return;
      const left = message.startsWith('left ') ? parseLeft(message) : null;
      if (left) {
        for (const listener of [...set]) listener.left(left.line, left.count);
        return;
      }
      const freed = parseFreed(message);
      if (freed) for (const listener of [...set]) listener.freed(freed);
    });
    this.connection = connection;
    connection.connect().catch(() => undefined);
    this.keepalive = setInterval(() => this.check(connection), KEEPALIVE_MS);
    this.keepalive.unref();
    return connection;
  }

  /** PING while anyone listens; no answer in time: the link is dropped and made again (then subscribed anew). */
  private check(connection: Redis): void {
    if (this.listeners.size === 0 || connection.status !== 'ready') return;
    withTimeout(connection.ping(), this.config.REDIS_TIMEOUT_MS).catch(() => {
      if (!this.closed && connection.status === 'ready') connection.disconnect(true);
    });
  }

  /** A subscribed connection has nothing to send before it closes: it is dropped, which cannot hang. */
  onApplicationShutdown(): void {
    this.closed = true;
    clearInterval(this.keepalive);
    this.connection?.disconnect();
  }
}
