"""Training text for the tiny BPE tokenizers: short excerpts of public-domain works (US federal
government documents and 19th-century novels), typed in here so that the fixtures need no download."""

GETTYSBURG = """Four score and seven years ago our fathers brought forth on this continent, a new nation,
conceived in Liberty, and dedicated to the proposition that all men are created equal.
Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and
so dedicated, can long endure. We are met on a great battle-field of that war. We have come to
dedicate a portion of that field, as a final resting place for those who here gave their lives that
that nation might live. It is altogether fitting and proper that we should do this.
But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this
ground. The brave men, living and dead, who struggled here, have consecrated it, far above our poor
power to add or detract. The world will little note, nor long remember what we say here, but it can
never forget what they did here. It is for us the living, rather, to be dedicated here to the
unfinished work which they who fought here have thus far so nobly advanced. It is rather for us to be
here dedicated to the great task remaining before us -- that from these honored dead we take increased
devotion to that cause for which they gave the last full measure of devotion -- that we here highly
resolve that these dead shall not have died in vain -- that this nation, under God, shall have a new
birth of freedom -- and that government of the people, by the people, for the people, shall not
perish from the earth.
"""

DECLARATION = """When in the Course of human events, it becomes necessary for one people to dissolve the
political bands which have connected them with another, and to assume among the powers of the earth,
the separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent
respect to the opinions of mankind requires that they should declare the causes which impel them to
the separation. We hold these truths to be self-evident, that all men are created equal, that they
are endowed by their Creator with certain unalienable Rights, that among these are Life, Liberty and
the pursuit of Happiness. That to secure these rights, Governments are instituted among Men, deriving
their just powers from the consent of the governed.
"""

PRIDE = """It is a truth universally acknowledged, that a single man in possession of a good fortune,
must be in want of a wife. However little known the feelings or views of such a man may be on his
first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families,
that he is considered the rightful property of some one or other of their daughters.
"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at
last?" Mr. Bennet replied that he had not. "But it is," returned she; "for Mrs. Long has just been
here, and she told me all about it." Mr. Bennet made no answer. "Do you not want to know who has
taken it?" cried his wife impatiently. "You want to tell me, and I have no objection to hearing it."
This was invitation enough.
"""

MOBY = """Call me Ishmael. Some years ago -- never mind how long precisely -- having little or no money in
my purse, and nothing particular to interest me on shore, I thought I would sail about a little and
see the watery part of the world. It is a way I have of driving off the spleen and regulating the
circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly
November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and
bringing up the rear of every funeral I meet; then, I account it high time to get to sea as soon as
I can. This is my substitute for pistol and ball.
"""

ALICE = """Alice was beginning to get very tired of sitting by her sister on the bank, and of having
nothing to do: once or twice she had peeped into the book her sister was reading, but it had no
pictures or conversations in it, "and what is the use of a book," thought Alice "without pictures or
conversations?" So she was considering in her own mind (as well as she could, for the hot day made
her feel very sleepy and stupid), whether the pleasure of making a daisy-chain would be worth the
trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran close
by her. There was nothing so very remarkable in that; nor did Alice think it so very much out of the
way to hear the Rabbit say to itself, "Oh dear! Oh dear! I shall be late!"
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1863 1776 2024. Code: def f(x): return x * 2 + 1
"""

CORPUS = [GETTYSBURG, DECLARATION, PRIDE, MOBY, ALICE]
